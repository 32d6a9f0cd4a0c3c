"""Enums and small value types of the public API (API.md §1, §6)."""
import enum

import torch

from dynamicemb import rules


class DynamicEmbScoreStrategy(enum.IntEnum):
    """How a row's score is set; eviction takes the lowest score of a bucket.

    The pair ``(TIMESTAMP, LFU)`` (see :func:`strategy_code`) evicts by access
    count and keeps the last access time for incremental dumps.
    """

    TIMESTAMP = 0  # monotonic clock at the last access (LRU)
    STEP = 1  # the caller's training step at the last access
    CUSTOMIZED = 2  # a score given with the keys (or through set_score)
    LFU = 3  # number of accesses
    NO_EVICTION = 4  # never evict: an insert into a full bucket fails


# Internal code of the (TIMESTAMP, LFU) pair (table_rules.h: kTimestampLfu).
TIMESTAMP_LFU = rules.TIMESTAMP_LFU
_PAIR = (DynamicEmbScoreStrategy.TIMESTAMP, DynamicEmbScoreStrategy.LFU)


def strategy_code(strategy) -> int:
    """The kernel code of a strategy: one enum member or the (TIMESTAMP, LFU) pair."""
    if isinstance(strategy, (tuple, list, set, frozenset)):
        members = {DynamicEmbScoreStrategy(s) for s in strategy}
        if members == set(_PAIR):
            return TIMESTAMP_LFU
        if len(members) == 1:
            return int(next(iter(members)))
        raise ValueError(
            f"score_strategy {strategy!r}: the only supported pair is (TIMESTAMP, LFU)"
        )
    try:
        return int(DynamicEmbScoreStrategy(strategy))
    except ValueError:
        raise ValueError(f"unknown score_strategy {strategy!r}") from None


def strategy_of(code: int):
    """The score strategy of a kernel code, as strategy_code takes it: an
    enum member, or the (TIMESTAMP, LFU) pair."""
    return _PAIR if code == TIMESTAMP_LFU else DynamicEmbScoreStrategy(code)


def strategy_label(code: int) -> str:
    """A strategy code for people: TIMESTAMP, ..., (TIMESTAMP, LFU)."""
    s = strategy_of(code)
    return f"({', '.join(m.name for m in s)})" if isinstance(s, tuple) else s.name


class InsertResult(enum.IntEnum):
    """Per-key outcome of ScoredHashTable.insert (table_rules.h: InsertResult)."""

    INSERTED = 0  # stored in a free slot
    ASSIGNED = 1  # already present
    EVICTED = 2  # stored by evicting the lowest-scored slot of its bucket
    FAILED = 3  # not stored (and counted)


class DynamicEmbCheckMode(enum.IntEnum):
    """What a failed insert does (API.md §3)."""

    ERROR = 0
    WARNING = 1
    IGNORE = 2


class DynamicEmbPoolingMode(enum.IntEnum):
    SUM = 0
    MEAN = 1
    NONE = 2


def canonical_device(device) -> torch.device:
    """The device with its index ("cuda" -> "cuda:<current>"), so that it
    compares equal to the device of the tensors placed on it."""
    d = torch.device("cpu" if device is None else device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d
