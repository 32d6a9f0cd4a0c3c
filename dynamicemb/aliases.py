"""NVIDIA dynamicemb's names where they mean what ours mean (API.md "Coming
from NVIDIA dynamicemb"): accepted with a DeprecationWarning that names ours.
Where our behaviour differs on purpose (defaults, return values), nothing is
aliased here: the doc says what to change."""
import enum
import warnings
from typing import Dict

from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = ["DynamicEmbEvictStrategy"]


def renamed(theirs: str, ours: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{theirs} is NVIDIA dynamicemb's name; dynamicemb's is {ours}", DeprecationWarning,
                  stacklevel=stacklevel)


class DynamicEmbEvictStrategy(enum.Enum):
    """NVIDIA dynamicemb's eviction strategies, for
    DynamicEmbTableOptions(evict_strategy=...) (deprecated: the score
    strategy decides eviction here)."""

    LRU = "lru"
    LFU = "lfu"
    EPOCH_LRU = "epoch_lru"
    EPOCH_LFU = "epoch_lfu"
    CUSTOMIZED = "customized"


# What each evicts by, as our score strategy; the EPOCH_ ones have no counterpart.
_EVICT_SCORE = {"LRU": DynamicEmbScoreStrategy.TIMESTAMP, "LFU": DynamicEmbScoreStrategy.LFU,
                "CUSTOMIZED": DynamicEmbScoreStrategy.CUSTOMIZED}


def score_strategy_of_evict(evict) -> DynamicEmbScoreStrategy:
    """Our score strategy for NVIDIA's evict_strategy (its member, name or value)."""
    name = getattr(evict, "name", evict)
    name = str(name).rsplit(".", 1)[-1].upper()
    if name in _EVICT_SCORE:
        return _EVICT_SCORE[name]
    raise ValueError(f"evict_strategy {evict!r} has no dynamicemb counterpart; use score_strategy "
                     f"(TIMESTAMP evicts the least recently used, LFU the least frequently used, CUSTOMIZED "
                     f"the lowest given score)")


def flat_per_table(value, what: str, ours: str):
    """NVIDIA's per-collection form {collection: {table: x}} (or
    {collection: [table, ...]}) as ours, {table: x} ([table, ...]), with a
    DeprecationWarning naming ours; any other value unchanged. Table names
    are unique across a model here, so the collection adds nothing."""
    if not isinstance(value, dict) or not value or not all(isinstance(v, (dict, list, tuple))
                                                           for v in value.values()):
        return value
    renamed(f"{what} as {{collection: ...}}", ours, stacklevel=4)
    as_list = all(isinstance(v, (list, tuple)) for v in value.values())
    flat: Dict[str, object] = {}
    for collection, tables in value.items():
        for name in tables:
            if name in flat:
                raise ValueError(f"{what}: table {name!r} is named in two collections; dynamicemb table names "
                                 f"are unique across the model")
            flat[name] = None if as_list else tables[name]
    return list(flat) if as_list else flat
