"""Enums and small value types of the public API (API.md §1, §6)."""
import enum
import operator

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


def strategy_name(code: int) -> str:
    """A kernel code's strategy as messages name it: "LFU", "(TIMESTAMP, LFU)"."""
    s = strategy_of(code)
    return f"({', '.join(m.name for m in s)})" if isinstance(s, tuple) else s.name


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


# ---- input checks shared by the module, the input dist and serving ------------------------

ID_DTYPES = (torch.int64, torch.int32)


def check_ids(values: torch.Tensor, features, owner: str) -> None:
    """Refuses ids that are not integers (a cast would silently truncate them)."""
    if not isinstance(values, torch.Tensor) or values.dtype not in ID_DTYPES:
        raise TypeError(f"{owner}: ids of features {list(features)} must be int64 or int32, "
                        f"got {getattr(values, 'dtype', type(values).__name__)}")


def check_finite_weights(weights, offsets: torch.Tensor, features, owner: str) -> None:
    """Refuses NaN / inf per-sample weights (they would poison the rows they
    update). One reduction when all are finite; `offsets` ([F * B + 1]) and
    `features` (F names, or a function returning them: built only for the
    message) name the first bad weight's feature otherwise."""
    # The sum is non-finite if any weight is (one reduction); an overflow of finite ones is checked exactly.
    if weights is None or bool(torch.isfinite(weights.sum())) or bool(torch.isfinite(weights).all()):
        return
    i = int((~torch.isfinite(weights)).nonzero()[0])
    features = list(features() if callable(features) else features)
    bag = int(torch.searchsorted(offsets.to(torch.int64), torch.tensor(i, device=offsets.device), right=True)) - 1
    B = max(1, (offsets.numel() - 1) // max(1, len(features)))
    f = min(bag // B, len(features) - 1)
    raise ValueError(f"{owner}: per-sample weight {i} (feature {features[f]!r}, bag {bag % B}) is "
                     f"{float(weights[i])}; weights must be finite")


def int_like(value, says: str) -> int:
    """An int, or a numpy / 0-d tensor integer, as an int; a bool, a float or
    anything else raises TypeError(f"{says}, got {value!r}")."""
    try:
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{says}, got {value!r}") from None


def int64_score(value, where: str) -> int:
    """A score or score threshold given by the user: an int in int64's range
    (a float or string was truncated or parsed, and an int past int64 failed
    in the next forward, after the step had counted)."""
    try:
        v = int_like(value, where)
    except TypeError:
        v = None
    if v is None or not -2**63 <= v < 2**63:
        raise ValueError(f"{where}: a score must be an int in int64's range, got {value!r}")
    return v


def checked_table_names(table_names, what: str) -> list:
    """A list of table names given by the user, refusing what would be read
    otherwise: a string (letter by letter), none, or one named twice."""
    if isinstance(table_names, str):
        raise TypeError(f"{what}: table_names must be a list of table names, got the string {table_names!r}; "
                        f"write [{table_names!r}]")
    names = list(table_names)
    if not names:
        raise ValueError(f"{what}: table_names is empty; name the tables (or leave it out: every table)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{what}: table_names names {twice} more than once")
    return names
