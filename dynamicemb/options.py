"""Per-table options (API.md §1; the admission types come from dynamicemb.admission), and table sizing."""
import enum
import math
import numbers
import os
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from dynamicemb import rules
from dynamicemb.admission import (AdmissionStrategy, Counter, FrequencyAdmissionStrategy,  # noqa: F401 - re-exported
                                  KVCounter)
from dynamicemb.aliases import renamed, score_strategy_of_evict
from dynamicemb.memory import TABLE_BYTES_PER_SLOT, table_bytes  # noqa: F401 - re-exported (sizing)
from dynamicemb.optimizer import EmbOptimType, optimizer_code, state_width
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbScoreStrategy, strategy_code


class DynamicEmbInitializerMode(enum.IntEnum):
    """Codes match init::Mode in csrc/embedding/init_rules.h."""

    NORMAL = 0
    TRUNCATED_NORMAL = 1
    UNIFORM = 2
    CONSTANT = 3
    DEBUG = 4  # key mod 100000 / 100 + j / 10000: readable values for tests

    @classmethod
    def _missing_(cls, value):
        """NVIDIA's string values ("uniform"): accepted, with a DeprecationWarning."""
        if isinstance(value, str) and value.upper() in cls.__members__:
            renamed(f"DynamicEmbInitializerMode({value!r})", f"DynamicEmbInitializerMode.{value.upper()}", 5)
            return cls[value.upper()]
        return None


@dataclass
class DynamicEmbInitializerArgs:
    """How a new key's row is initialised. Unset UNIFORM bounds default to
    ±sqrt(1 / num_embeddings); unset TRUNCATED_NORMAL bounds to mean ± 2 std_dev."""

    mode: DynamicEmbInitializerMode = DynamicEmbInitializerMode.UNIFORM
    mean: float = 0.0
    std_dev: float = 1.0
    lower: Optional[float] = None
    upper: Optional[float] = None
    value: float = 0.0

    def __post_init__(self):
        try:
            self.mode = DynamicEmbInitializerMode(self.mode)
        except ValueError:
            raise ValueError(f"DynamicEmbInitializerArgs.mode: unknown initializer {self.mode!r}; use one of "
                             f"{[m.name for m in DynamicEmbInitializerMode]}") from None
        for f in ("mean", "std_dev", "lower", "upper", "value"):
            v = getattr(self, f)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
                raise ValueError(f"DynamicEmbInitializerArgs.{f} must be a finite number, got {v!r}")
        if self.std_dev < 0:
            raise ValueError(f"DynamicEmbInitializerArgs.std_dev must be >= 0, got {self.std_dev}")
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise ValueError(f"DynamicEmbInitializerArgs: initializer lower bound {self.lower} exceeds upper bound "
                             f"{self.upper}")

    def packed(self, num_embeddings: Optional[int], stream: int, state: float = 0.0) -> list:
        """The float64 row the kernels take (init::Args), its columns in
        rules.INIT_ARGS order; `stream` is the table's random stream id,
        `state` the value a new row's optimizer state starts at."""
        lower, upper = self.lower, self.upper
        default = ""  # which bound was a default, for the message
        if self.mode == DynamicEmbInitializerMode.UNIFORM:
            bound = math.sqrt(1.0 / num_embeddings) if num_embeddings else 0.0
            what = f"the default sqrt(1 / num_embeddings {num_embeddings})"
            default = f" ({'lower' if lower is None else 'upper'}: {what})" if (lower is None) != (upper is None) \
                else ""
            lower = -bound if lower is None else lower
            upper = bound if upper is None else upper
        elif self.mode == DynamicEmbInitializerMode.TRUNCATED_NORMAL:
            default = (" (the default: mean +- 2 std_dev)" if (lower is None) != (upper is None) else "")
            lower = self.mean - 2 * self.std_dev if lower is None else lower
            upper = self.mean + 2 * self.std_dev if upper is None else upper
        if lower is not None and upper is not None and lower > upper:
            raise ValueError(f"initializer lower bound {lower} exceeds upper bound {upper}{default}; give both")
        row = dict(mode=float(int(self.mode)), mean=self.mean, std_dev=self.std_dev, lower=lower or 0.0,
                   upper=upper or 0.0, value=self.value, stream=float(stream), state=float(state))
        return [row[name] for name in rules.INIT_ARGS]


def _positive_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0


_WARNED_STORAGES = weakref.WeakSet()  # external_storage objects already warned about


def _first_sight(obj) -> bool:
    try:
        if obj in _WARNED_STORAGES:
            return False
        _WARNED_STORAGES.add(obj)
    except TypeError:  # not weakly referable: warn each time
        pass
    return True


@dataclass
class DynamicEmbTableOptions:
    dim: Optional[int] = None
    embedding_dtype: Optional[torch.dtype] = None
    index_type: torch.dtype = torch.int64
    init_capacity: Optional[int] = None
    max_capacity: Optional[int] = None
    max_load_factor: float = 0.5
    bucket_capacity: int = 128
    score_strategy: object = DynamicEmbScoreStrategy.TIMESTAMP
    initializer_args: DynamicEmbInitializerArgs = field(default_factory=DynamicEmbInitializerArgs)
    eval_initializer_args: DynamicEmbInitializerArgs = field(
        default_factory=lambda: DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=0.0)
    )
    safe_check_mode: DynamicEmbCheckMode = DynamicEmbCheckMode.WARNING
    global_hbm_for_values: int = 0
    caching: bool = False
    dist_type: str = "hash_roundrobin"
    # Admission (dynamicemb.admission): a FrequencyAdmissionStrategy or any
    # AdmissionStrategy, with a KVCounter or any Counter.
    admit_strategy: Optional[AdmissionStrategy] = None
    admission_counter: Optional[Counter] = None
    training: bool = True
    # The table's global row count (TorchRec's num_embeddings), for the
    # default initializer bounds; filled by the planner when None.
    num_embeddings: Optional[int] = None
    # Ranks the table is sharded over (filled by the planner): each rank's
    # share of global_hbm_for_values is global_hbm_for_values / num_shards.
    num_shards: int = 1
    # With caching=True: where rows the cache does not hold live. A
    # dynamicemb.tiers.BackingStore (one object may serve several tables:
    # they are told apart by name); else a FileStore in storage_path (a
    # directory; each rank writes its own files there) when given; else a
    # HostStore (host memory).
    backing_store: Optional[object] = None
    storage_path: Optional[str] = None
    # Bytes on each rank that the table (rows of values and optimizer state,
    # plus TABLE_BYTES_PER_SLOT per hash table slot: table_bytes) may grow
    # to. max_capacity is where growth starts to be checked against it: a
    # table grows to max_capacity whatever its budget, and past it only a
    # NO_EVICTION table grows (doubling while the doubled table fits the
    # budget); once it cannot, its new keys fail (counted; a WARNING once per
    # table, DynamicEmbBudgetError under ERROR). None: what the planner
    # allots (DynamicEmbeddingShardingPlanner's no_eviction_growth), and
    # outside the planner the table's bytes at max_capacity (no growth past it).
    memory_budget: Optional[int] = None
    # NVIDIA dynamicemb's names (deprecated, API.md "Coming from NVIDIA
    # dynamicemb"): evict_strategy sets score_strategy; external_storage (an
    # NVIDIA Storage) becomes the backing store of a cached table
    # (dynamicemb.tiers.NvidiaStorageStore wraps it).
    evict_strategy: Optional[object] = None
    external_storage: Optional[object] = None

    @property
    def local_hbm_for_values(self) -> int:
        """This rank's bytes of accelerator memory for values (0: no limit)."""
        return self.global_hbm_for_values // max(1, self.num_shards)

    def hbm_rows(self, row_bytes: int) -> Optional[int]:
        """Rows (values and optimizer state, `row_bytes` each) that this
        rank's share of global_hbm_for_values holds; None: no limit. A table
        with more rows is hybrid (table_rows.py): its first rows stay in
        accelerator memory, the rest in pinned host memory, which the kernels
        read and update in place."""
        return None if self.global_hbm_for_values == 0 else self.local_hbm_for_values // row_bytes

    @property
    def grows_past_max_capacity(self) -> bool:
        """Whether the table grows past max_capacity into its memory_budget:
        a NO_EVICTION table (it cannot evict), unless cached (a cache never
        grows)."""
        return not self.caching and not rules.may_evict(strategy_code(self.score_strategy))

    def cache_rows(self, width: int, itemsize: int) -> int:
        """Rows of a cached table's cache on this rank (rows of `width`
        elements of `itemsize` bytes): its share of global_hbm_for_values,
        in whole buckets, at most max_capacity."""
        rows = self.local_hbm_for_values // (width * itemsize)
        rows = rows // self.bucket_capacity * self.bucket_capacity
        return max(self.bucket_capacity, min(rows, self.max_capacity))

    def __post_init__(self):
        self._aliases()
        # Fields the planner fills in later (dim, max_capacity, ...) may be None here.
        self._check(lambda msg: f"DynamicEmbTableOptions: {msg}", complete=False)

    def _aliases(self) -> None:
        """NVIDIA's option names as ours (aliases.py)."""
        if self.evict_strategy is not None:
            strategy = score_strategy_of_evict(self.evict_strategy)
            # As in NVIDIA's, an explicit score strategy decides; the default (TIMESTAMP) yields.
            given = self.score_strategy
            if given is DynamicEmbScoreStrategy.TIMESTAMP:
                self.score_strategy = strategy
            label = getattr(given, "name", given)
            kept = ("" if self.score_strategy == strategy else
                    f"; the score_strategy given ({label}) decides here, so this table evicts by {label}, "
                    f"not by evict_strategy")
            renamed(f"evict_strategy={self.evict_strategy}", f"score_strategy=DynamicEmbScoreStrategy.{strategy.name}"
                    f" (eviction follows the score strategy){kept}", 5)
            self.evict_strategy = None
        # Once per storage: the module re-creates options (dataclasses.replace) with it.
        if self.external_storage is not None and _first_sight(self.external_storage):
            renamed("external_storage", "backing_store (a dynamicemb.tiers.BackingStore, with caching=True and "
                    "global_hbm_for_values for the cache in front of it); an NVIDIA Storage is wrapped by "
                    "dynamicemb.tiers.NvidiaStorageStore", 5)
        if self.external_storage is not None:
            if self.backing_store is not None:
                raise ValueError("DynamicEmbTableOptions: give backing_store or external_storage, not both")
            self.caching = True

    def validate(self, name: str, complete: bool = True) -> None:
        """Raises ValueError naming the table for options that cannot work
        (again: fields may have been set since construction); `complete`:
        every field must be filled in by now (dim, max_capacity)."""
        self._check(lambda msg: f"table {name!r}: {msg}", complete=complete)

    def _check(self, where, complete: bool) -> None:
        def bad(msg):
            raise ValueError(where(msg))

        def given(v):
            return complete or v is not None

        if given(self.dim) and not _positive_int(self.dim):
            bad(f"dim must be a positive int, got {self.dim!r}")
        if self.index_type not in (torch.int64, torch.int32):
            bad(f"index_type must be torch.int64 or torch.int32, got {self.index_type}")
        if self.embedding_dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
            bad(f"embedding_dtype must be float32, float16 or bfloat16, got {self.embedding_dtype}")
        if not _positive_int(self.bucket_capacity) or self.bucket_capacity % 16:
            bad(f"bucket_capacity must be a positive multiple of 16, got {self.bucket_capacity!r}")
        if given(self.max_capacity) and not _positive_int(self.max_capacity):
            bad(f"max_capacity must be a positive int, got {self.max_capacity!r}")
        if self.init_capacity is not None and not (
                _positive_int(self.init_capacity) and (self.max_capacity is None or self.init_capacity <= self.max_capacity)):
            bad(f"init_capacity {self.init_capacity!r} must be in (0, max_capacity={self.max_capacity}]")
        if isinstance(self.max_load_factor, bool) or not (
                isinstance(self.max_load_factor, (int, float)) and 0 < self.max_load_factor <= 1):
            bad(f"max_load_factor must be in (0, 1], got {self.max_load_factor!r}")
        try:
            strategy_code(self.score_strategy)
        except (ValueError, TypeError):
            bad(f"unknown score_strategy {self.score_strategy!r}; use a DynamicEmbScoreStrategy or "
                f"(TIMESTAMP, LFU)")
        for f in ("initializer_args", "eval_initializer_args"):
            if not isinstance(getattr(self, f), DynamicEmbInitializerArgs):
                bad(f"{f} must be a DynamicEmbInitializerArgs, got {getattr(self, f)!r}")
        try:
            self.safe_check_mode = DynamicEmbCheckMode(self.safe_check_mode)
        except ValueError:
            bad(f"unknown safe_check_mode {self.safe_check_mode!r}; use ERROR, WARNING or IGNORE")
        for f in ("caching", "training"):
            if not isinstance(getattr(self, f), bool):
                bad(f"{f} must be a bool, got {getattr(self, f)!r}")
        if self.dist_type not in ("hash_roundrobin", "roundrobin", "continuous"):
            bad(f"unknown dist_type {self.dist_type!r}; use 'hash_roundrobin', 'roundrobin' or 'continuous'")
        if not isinstance(self.global_hbm_for_values, numbers.Integral) or self.global_hbm_for_values < 0:
            bad(f"global_hbm_for_values must be >= 0 bytes, got {self.global_hbm_for_values!r}")
        if self.memory_budget is not None and not _positive_int(self.memory_budget):
            bad(f"memory_budget must be a positive int (bytes per rank), got {self.memory_budget!r}")
        if self.num_embeddings is not None and not _positive_int(self.num_embeddings):
            bad(f"num_embeddings must be a positive int, got {self.num_embeddings!r}")
        if not _positive_int(self.num_shards):
            bad(f"num_shards must be a positive int, got {self.num_shards!r}")
        if self.admit_strategy is not None and not isinstance(self.admit_strategy, AdmissionStrategy):
            bad(f"admit_strategy must be a FrequencyAdmissionStrategy or another dynamicemb.AdmissionStrategy, got "
                f"{self.admit_strategy!r}")
        if self.admission_counter is not None and not isinstance(self.admission_counter, Counter):
            bad(f"admission_counter must be a KVCounter or another dynamicemb.Counter, got "
                f"{self.admission_counter!r}")
        if self.admit_strategy is not None:
            init = self.admit_strategy.get_initializer_args()
            if init is not None and not isinstance(init, DynamicEmbInitializerArgs):
                bad(f"admit_strategy's initializer_args must be a DynamicEmbInitializerArgs or None, got {init!r}")
        if (self.admit_strategy is None) != (self.admission_counter is None):
            bad("admit_strategy and admission_counter must be given together")
        if self.storage_path is not None and not isinstance(self.storage_path, (str, os.PathLike)):
            bad(f"storage_path must be a directory path, got {self.storage_path!r}")
        if not complete:  # caching, the cache's bytes and its store may be set in either order
            return
        if self.caching and self.global_hbm_for_values <= 0:
            bad(("external_storage puts a cache in front of the store: " if self.external_storage is not None
                 else "") + "caching=True needs global_hbm_for_values > 0: the bytes of the cache (values and "
                "optimizer state) over all ranks")
        if (self.backing_store is not None or self.storage_path is not None) and not self.caching:
            bad("backing_store and storage_path are for caching=True (rows the cache does not hold)")
        if self.caching and not rules.may_evict(strategy_code(self.score_strategy)):
            bad("caching=True needs a score strategy that evicts: the cache makes room by evicting its "
                "lowest-scored rows to the backing store, and a full store evicts too; a NO_EVICTION cache would "
                "serve every later key from the store, and the store would drop trained rows. Use a scored "
                "strategy, or caching=False (a NO_EVICTION table then grows into its memory_budget)")


# ---- sizing (used by the planner; importable without torchrec) -------------------------


def _numbers_not_a_config(what: str, first, takes: str) -> None:
    """NVIDIA dynamicemb's sizing helpers take a table config first; ours take numbers."""
    if not isinstance(first, numbers.Integral) and hasattr(first, "embedding_dim"):
        raise TypeError(f"{what} takes numbers ({takes}), not a table config as NVIDIA dynamicemb's does: pass "
                        f"its num_embeddings / embedding_dim")

def get_sharded_table_capacity(num_embeddings: int, world_size: int, bucket_capacity: int = 128) -> int:
    """Rows per rank of a dynamic table of `num_embeddings` rows over
    `world_size` ranks: ceil(num_embeddings / world_size), in whole buckets."""
    _numbers_not_a_config("get_sharded_table_capacity", num_embeddings, "num_embeddings, world_size, bucket_capacity")
    if num_embeddings <= 0 or world_size <= 0:
        raise ValueError(f"num_embeddings ({num_embeddings}) and world_size ({world_size}) must be positive")
    rows = -(-num_embeddings // world_size)
    return -(-rows // bucket_capacity) * bucket_capacity


def get_table_value_bytes(capacity: int, dim: int, embedding_dtype: torch.dtype = torch.float32,
                          optimizer=EmbOptimType.EXACT_SGD, training: bool = True) -> int:
    """Bytes of a table's values and optimizer state at `capacity` rows."""
    _numbers_not_a_config("get_table_value_bytes", capacity, "capacity, dim, embedding_dtype, optimizer")
    width = dim + (state_width(optimizer_code(optimizer), dim) if training else 0)
    return capacity * width * torch.empty((), dtype=embedding_dtype).element_size()
