"""Planning collections with dynamic tables (API.md §2).

Dynamic tables are planned ROW_WISE over all ranks with CUSTOMIZED_KERNEL and
our own storage estimate (their per-rank values and optimizer state, plus the
hash table); TorchRec's planner plans the native tables unchanged, on a
topology whose memory is reduced by what the dynamic tables take.
"""
import copy
import dataclasses
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import row_wise
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType

from dynamicemb import rules
from dynamicemb.admission import KVCounter
from dynamicemb.config_init import table_initializer
from dynamicemb.optimizer import EmbOptimType, optimizer_code
from dynamicemb.memory import TABLE_BYTES_PER_SLOT
# The sizing helpers live in options.py (importable without torchrec); re-exported here.
from dynamicemb.options import DynamicEmbTableOptions, get_sharded_table_capacity, get_table_value_bytes
from dynamicemb.storage import capacities_of
from dynamicemb.tiers.index import index_capacities
from dynamicemb.tiers.store import DEFAULT_BUCKET as _STORE_BUCKET, ROOM_MARGIN
from dynamicemb.types import strategy_code
from dynamicemb.shard import DynamicSharderMixin
from dynamicemb.shard.parameter_sharding import CUSTOMIZED, DynamicEmbParameterSharding

__all__ = ["DynamicEmbParameterConstraints", "DynamicEmbeddingShardingPlanner"]

# Options, table_stats, dumps and checkpoints address a dynamic table by its name.
_UNIQUE_NAMES = ("a dynamic table's name must be unique in the model (its options, table_stats, dumps and "
                 "checkpoints address it by name); rename one")
_DTYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}


@dataclass
class DynamicEmbParameterConstraints(ParameterConstraints):
    """ParameterConstraints that can make a table dynamic.

    A dynamic table's constraints allow only CUSTOMIZED_KERNEL (its
    `compute_kernels` default): DynamicEmbeddingShardingPlanner places it so,
    and TorchRec's own planner, which cannot make it dynamic, then refuses to
    plan it instead of planning a static table that folds its ids."""

    use_dynamicemb: bool = False
    dynamicemb_options: DynamicEmbTableOptions = field(default_factory=DynamicEmbTableOptions)

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)  # (TorchRec 1.8's ParameterConstraints has none)
        if parent is not None:
            parent()
        if self.use_dynamicemb and self.compute_kernels is None:
            self.compute_kernels = [CUSTOMIZED]
        if not self.use_dynamicemb and self.dynamicemb_options != DynamicEmbTableOptions():
            warnings.warn("DynamicEmbParameterConstraints: dynamicemb_options given with use_dynamicemb=False: the "
                          "table is planned as a native TorchRec table and the options are not used; set "
                          "use_dynamicemb=True to make it dynamic", UserWarning, stacklevel=3)


def complete_options(config: BaseEmbeddingConfig, options: DynamicEmbTableOptions, world_size: int
                     ) -> DynamicEmbTableOptions:
    """The per-rank options of a table: dim, dtype, capacity, initializer
    (config_init.py) and its default bounds from the TorchRec config. Refuses
    options contradicting it."""
    name = config.name
    dtype = _DTYPES.get(config.data_type)
    if dtype is None:
        raise ValueError(f"table {name!r}: data_type {config.data_type} is not supported by dynamic tables")
    if options.dim is not None and options.dim != config.embedding_dim:
        raise ValueError(f"table {name!r}: dynamicemb_options.dim={options.dim!r} contradicts the table's "
                         f"embedding_dim={config.embedding_dim}")
    if options.embedding_dtype is not None and options.embedding_dtype != dtype:
        raise ValueError(f"table {name!r}: dynamicemb_options.embedding_dtype={options.embedding_dtype} "
                         f"contradicts the table's data_type={config.data_type}")
    if options.num_embeddings is not None and options.num_embeddings != config.num_embeddings:
        raise ValueError(f"table {name!r}: dynamicemb_options.num_embeddings={options.num_embeddings!r} contradicts "
                         f"the table's num_embeddings={config.num_embeddings}")
    if not isinstance(config.num_embeddings, int) or config.num_embeddings <= 0:
        # (TorchRec's config takes it with explicit weight_init bounds; it sizes max_capacity and the default init.)
        raise ValueError(f"table {name!r}: num_embeddings={config.num_embeddings!r} must be a positive int (a "
                         f"dynamic table grows past it, but it sizes the default max_capacity and initializer)")
    policy = getattr(config, "virtual_table_eviction_policy", None)
    if policy is not None:
        raise ValueError(f"table {name!r}: virtual_table_eviction_policy ({type(policy).__name__}) configures "
                         f"TorchRec's own key-value tables; a dynamic table evicts by "
                         f"dynamicemb_options.score_strategy (NO_EVICTION: it never evicts); leave it unset")
    options.validate(name, complete=False)  # fields set since construction: named by table before the copy
    max_cap = options.max_capacity or get_sharded_table_capacity(config.num_embeddings, world_size,
                                                                 options.bucket_capacity)
    try:  # (the copy validates the options it completes: an init_capacity past the derived max_capacity, the
        # initializer's bounds against the default ones of num_embeddings)
        initializer = table_initializer(config, options.initializer_args)
        out = dataclasses.replace(options, dim=config.embedding_dim, embedding_dtype=dtype, max_capacity=max_cap,
                                  num_embeddings=config.num_embeddings, num_shards=world_size,
                                  initializer_args=initializer)
    except ValueError as e:
        derived = "" if options.max_capacity else (f" (max_capacity {max_cap}: num_embeddings "
                                                   f"{config.num_embeddings} over {world_size} ranks)")
        raise ValueError(f"table {name!r}{derived}: {e}") from None
    out.validate(name)
    return out


def _values(names) -> List[str]:
    """Constraint names as strings (an enum, e.g. ShardingType.ROW_WISE, as its value)."""
    return [getattr(n, "value", n) for n in names]


class DynamicEmbeddingShardingPlanner:
    """Plans dynamic tables ROW_WISE / CUSTOMIZED_KERNEL and delegates the
    native tables to TorchRec's EmbeddingShardingPlanner (extra keyword
    arguments go to it).

    A dynamic table's storage estimate includes the state of the optimizer
    its kernel will run: the one in the `fused_params` of the sharder that
    shards its module (or set on the parameter with TorchRec's
    `apply_optimizer_in_backward`), known at `plan()` / `collective_plan()`.
    `optimizer=` overrides that for the estimate only, and must agree with it.

    Every dynamic table gets a memory budget (its options' memory_budget,
    bytes per rank): what the planner reserves for it. A NO_EVICTION table
    (not cached) grows past max_capacity into its budget: its
    memory_budget when given (reserved in full), else its share, in
    proportion to its bytes at max_capacity, of `no_eviction_growth` (a
    fraction) of the memory its rows' tier has left on the tightest rank
    after the dynamic tables' reservation. That share is reserved too:
    native tables are planned in the rest. 0 keeps such tables at
    max_capacity.
    """

    def __init__(self, eb_configs: Sequence[BaseEmbeddingConfig], topology: Optional[Topology] = None,
                 batch_size: Optional[int] = None, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 optimizer=None, no_eviction_growth: float = 0.5, **kwargs):
        if not (isinstance(no_eviction_growth, (int, float)) and 0 <= no_eviction_growth <= 1):
            raise ValueError(f"no_eviction_growth must be a fraction in [0, 1], got {no_eviction_growth!r}")
        self.no_eviction_growth = no_eviction_growth
        self._configs = {c.name: c for c in eb_configs}
        constraints = dict(constraints or {})
        self._dynamic = {n: c for n, c in constraints.items()
                         if isinstance(c, DynamicEmbParameterConstraints) and c.use_dynamicemb}
        count = Counter(c.name for c in eb_configs)
        for name, c in self._dynamic.items():
            if name not in self._configs:
                raise ValueError(f"constraints name table {name!r}, which is not among the eb_configs")
            if count[name] > 1:
                raise ValueError(f"the eb_configs hold {count[name]} tables named {name!r}; {_UNIQUE_NAMES}")
            # Constraints list what a table may get (TorchRec's planner picks among them),
            # as strings; the enums (ShardingType.ROW_WISE) are read as their values.
            if c.sharding_types and ShardingType.ROW_WISE.value not in _values(c.sharding_types):
                raise ValueError(f"table {name!r}: dynamic tables are sharded ROW_WISE only, "
                                 f"constraints allow {c.sharding_types}")
            if c.compute_kernels and CUSTOMIZED not in _values(c.compute_kernels):
                raise ValueError(f"table {name!r}: dynamic tables run CUSTOMIZED_KERNEL only, "
                                 f"constraints allow {c.compute_kernels}")
            if c.key_value_params is not None:
                raise ValueError(f"table {name!r}: key_value_params configure TorchRec's SSD / key-value "
                                 f"kernels; a dynamic table keeps rows beyond memory with "
                                 f"dynamicemb_options caching=True and a backing store (HostStore, FileStore)")
        if not self._dynamic and eb_configs:
            warnings.warn(f"DynamicEmbeddingShardingPlanner: no table is dynamic (no "
                          f"DynamicEmbParameterConstraints(use_dynamicemb=True) among the constraints): all "
                          f"{len(eb_configs)} tables are planned as native TorchRec tables, whose ids must lie in "
                          f"[0, num_embeddings)", RuntimeWarning, stacklevel=2)
        native = {n: c for n, c in constraints.items() if n not in self._dynamic}
        # Our reservation takes the dynamic tables' bytes out of the planner's
        # topology: a copy, so that the user's (which other planners may be
        # given) stays as it was.
        self._native = EmbeddingShardingPlanner(topology=copy.deepcopy(topology), batch_size=batch_size,
                                                constraints=native, **kwargs)
        self._topology = self._native._topology
        if optimizer is not None:
            optimizer_code(optimizer)  # refuses an optimizer we do not implement
        self._optimizer_override = optimizer
        # The optimizer of each dynamic table, from its sharder (set by plan()).
        self.optimizers: Dict[str, object] = {}
        # The topology's memory before our reservation: plan() reserves anew
        # each time (the sharders, hence the optimizers, may change).
        self._free = [(d.storage.hbm, d.storage.ddr) for d in self._topology.devices]
        self.options = {n: complete_options(self._configs[n], c.dynamicemb_options, self._topology.world_size)
                        for n, c in self._dynamic.items()}
        # The users' memory budgets (plan() sets every table's anew).
        self._given_budget = {n: o.memory_budget for n, o in self.options.items()}

    # ---- storage -----------------------------------------------------------------------

    def dynamic_bytes_per_rank(self) -> Dict[str, int]:
        """Our storage estimate of each dynamic table on one rank: values and
        optimizer state at its maximum slots plus the hash table and an
        admission counter's (a cached table: its cache and backing store,
        see _tier_bytes). Needs the tables' optimizers: call after plan() (or
        give the planner `optimizer=`)."""
        return {n: sum(self._tier_bytes(n)) if o.caching else
                self._value_bytes(n) + self._table_bytes(n) for n, o in self.options.items()}

    def _row_bytes(self, name: str) -> int:
        o = self.options[name]
        optimizer = self.optimizers.get(name, self._optimizer_override)
        if optimizer is None:
            raise RuntimeError(f"table {name!r}: its optimizer (from the sharder's fused_params) is known once "
                               f"plan() or collective_plan() ran; pass optimizer= to estimate before that")
        return get_table_value_bytes(1, o.dim, o.embedding_dtype, optimizer, o.training)

    def _max_slots(self, name: str) -> int:
        """The slots a (not cached) table reaches: max_capacity rounded up so
        that its init_capacity doubles exactly into it, as the storage does."""
        return capacities_of(self.options[name])[1]

    def _value_bytes(self, name: str) -> int:
        return self._row_bytes(name) * self._max_slots(name)

    def _slot_bytes(self, name: str) -> int:
        """Hash table bytes per slot: the (TIMESTAMP, LFU) pair keeps an access time too."""
        o = self.options[name]
        return TABLE_BYTES_PER_SLOT + (8 if rules.keeps_timestamps(strategy_code(o.score_strategy)) else 0)

    def _counter_bytes(self, name: str) -> int:
        """An admission counter's bytes (a KVCounter: a hash table of its own, on the table's device)."""
        c = self.options[name].admission_counter
        if not isinstance(c, KVCounter):
            return 0
        return -(-c.capacity // c.bucket_capacity) * c.bucket_capacity * TABLE_BYTES_PER_SLOT

    def _table_bytes(self, name: str) -> int:
        """A table's hash table, and its admission counter's."""
        return self._max_slots(name) * self._slot_bytes(name) + self._counter_bytes(name)

    def _tier_bytes(self, name: str) -> Tuple[int, int]:
        """(device, host) bytes per rank of a caching=True table: its cache
        (rows of values and optimizer state, and their hash table) on the
        device; its backing store's key index (a hash table plus a row
        position per slot) and, for the host store, its rows in host memory.
        A file store's rows are on disk and a user's store is its own."""
        o = self.options[name]
        row = self._row_bytes(name)
        cached = o.cache_rows(row, 1)
        device = cached * (row + self._slot_bytes(name)) + self._counter_bytes(name)
        if o.backing_store is not None or o.external_storage is not None:
            return device, 0
        # The store's key index rounds the table's whole buckets up as an
        # index does (tiers/index.py); a HostStore's rows pass that room by
        # its margin (puts of up to that many rows at once stay within it).
        room = index_capacities(-(-o.max_capacity // o.bucket_capacity) * o.bucket_capacity, _STORE_BUCKET)[1]
        index = room * (TABLE_BYTES_PER_SLOT + 8)
        return device, index + (0 if o.storage_path is not None else row * (room + room // ROOM_MARGIN))

    def tier_bytes_per_rank(self) -> Dict[str, Tuple[int, int]]:
        """(HBM, DDR) bytes per rank of each dynamic table, as plan() charges
        them: on a CUDA topology the hash table and the rows (values and
        optimizer state) that its share of global_hbm_for_values holds to
        HBM, its other rows (a hybrid table's host part) to DDR; a cached
        table's cache to HBM and its backing store to DDR (see _tier_bytes).
        On a CPU topology everything is DDR."""
        on_device = self._topology.compute_device == "cuda"
        out = {}
        for n, o in self.options.items():
            values, table = self._value_bytes(n), self._table_bytes(n)
            if o.caching:
                cache, store = self._tier_bytes(n)
                out[n] = (cache, store) if on_device else (0, cache + store)
            elif not on_device:
                out[n] = (0, values + table)
            else:
                row = self._row_bytes(n)
                head = o.hbm_rows(row)
                head = values if head is None else min(values, head * row)
                out[n] = (table + head, values - head)
        return out

    def allotted_bytes_per_rank(self) -> Dict[str, Tuple[int, int]]:
        """(HBM, DDR) bytes per rank that plan() reserves for each dynamic
        table: tier_bytes_per_rank, and for a NO_EVICTION table its room to
        grow past max_capacity (charged to the tier of its rows; see the
        class doc). A table's memory budget is the sum."""
        tiers = self.tier_bytes_per_rank()
        out = {n: list(b) for n, b in tiers.items()}
        col = {n: 1 if b[1] else 0 for n, b in tiers.items()}  # the tier of a table's rows
        share = {}
        for n in tiers:
            if not self.options[n].grows_past_max_capacity:
                continue
            given = self._given_budget.get(n)
            if given is None:
                share[n] = sum(tiers[n])
            else:  # the budget is the table's (rows and slots); its admission counter comes on top
                out[n][col[n]] += max(0, given - (sum(tiers[n]) - self._counter_bytes(n)))
        for c in (0, 1):
            mine = {n: w for n, w in share.items() if col[n] == c}
            if not mine or self.no_eviction_growth == 0:
                continue
            left = min(free[c] for free in self._free) - sum(b[c] for b in out.values())
            pool = int(max(0, left) * self.no_eviction_growth)
            total = sum(mine.values())
            for n, w in mine.items():
                out[n][c] += pool * w // total
        return {n: (b[0], b[1]) for n, b in out.items()}

    def _reserve_dynamic_storage(self) -> None:
        """Takes our tables' bytes (allotted_bytes_per_rank) out of every
        rank's budget (as it was before any reservation) and sets each
        table's memory_budget to them. Refuses, naming the table, when one
        does not fit: the first whose bytes, added to those of the tables
        before it, exceed a rank's HBM or DDR."""
        tiers = self.allotted_bytes_per_rank()
        hbm = sum(h for h, _ in tiers.values())
        ddr = sum(d for _, d in tiers.values())
        for d, (free_hbm, free_ddr) in zip(self._topology.devices, self._free):
            for kind, col, need, have in (("HBM", 0, hbm, free_hbm), ("DDR", 1, ddr, free_ddr)):
                if need > have:
                    raise ValueError(self._overflow_message(tiers, kind, col, have, d.rank))
            d.storage.hbm = free_hbm - hbm
            d.storage.ddr = free_ddr - ddr
        for n, b in tiers.items():  # the table's own bytes (TableBudget counts rows and slots): less its counter's
            self.options[n] = dataclasses.replace(self.options[n], memory_budget=sum(b) - self._counter_bytes(n))

    def _overflow_message(self, tiers, kind: str, col: int, have: int, rank: int) -> str:
        taken, before = 0, []
        for name, bytes_ in tiers.items():
            if taken + bytes_[col] > have:
                break
            taken += bytes_[col]
            before.append(name)
        o = self.options[name]
        what = ("its cache" if kind == "HBM" else "its backing store" if bytes_[0] else
                "its cache and backing store") if o.caching else \
            ("its values, optimizer state and hash table" if bytes_[1 - col] == 0 else
             ("its hash table" if kind == "HBM" else "its values and optimizer state (host tier)"))
        if o.grows_past_max_capacity and self._given_budget.get(name) is not None:
            what += f" and room to grow to its memory_budget of {self._given_budget[name]} bytes"
        total = sum(b[col] for b in tiers.values())
        return (f"table {name!r} does not fit in {kind}: it needs {bytes_[col]} bytes of {kind} per rank "
                f"({what}, {o.max_capacity} rows per rank), but rank {rank} has {have - taken} of its {have} "
                f"bytes left after the tables before it ({before}); all dynamic tables need {total} bytes of "
                f"{kind} per rank ({ {n: b[col] for n, b in tiers.items()} }). Set dynamicemb_options.max_capacity "
                f"(rows per rank; by default num_embeddings over the ranks), a memory_budget, or caching=True "
                f"with a backing store")

    # ---- plans -------------------------------------------------------------------------

    def _native_sharders(self, sharders):
        """The sharders TorchRec's planner plans the native tables with: ours
        become the stock TorchRec sharders they extend (same fused_params),
        blind to the dynamic tables, so native tables get exactly the plan
        that TorchRec's sharders would give them."""
        exclude = frozenset(self._dynamic)
        return [s.planning_sharder(exclude) if isinstance(s, DynamicSharderMixin) else s for s in sharders]

    def _has_native(self, module, sharders) -> bool:
        by_type = {s.module_type: s for s in sharders}
        return any(type(m) in by_type and by_type[type(m)].shardable_parameters(m)
                   for _, m in module.named_modules())

    def _dynamic_tables(self, module, sharders) -> List[Tuple[str, str, torch.nn.Parameter, object]]:
        """(module path, table, parameter, sharder) of every dynamic table;
        refuses a dynamic table sharded by a sharder that is not ours, or
        missing from the module."""
        by_type = {s.module_type: s for s in sharders}
        found, sharded = [], []
        for path, m in module.named_modules():  # (parents first)
            sharder = by_type.get(type(m))
            if sharder is None or any(path.startswith(f"{p}.") or not p for p in sharded):
                continue  # (a module inside a sharded one is sharded with it, as TorchRec does)
            sharded.append(path)
            for name, param in sharder.shardable_parameters(m).items():
                if name not in self._dynamic:
                    continue
                if not isinstance(sharder, DynamicSharderMixin):
                    raise ValueError(f"table {name!r} is dynamic but module {path or '<root>'!r} is sharded by "
                                     f"{type(sharder).__name__}; use dynamicemb.shard's sharders")
                found.append((path, name, param, sharder))
        paths: Dict[str, List[str]] = {}
        for path, name, _, _ in found:
            paths.setdefault(name, []).append(path or "<root>")
        for name, where in paths.items():
            if len(where) > 1:
                raise ValueError(f"modules {where} each hold a table named {name!r}; {_UNIQUE_NAMES}")
        missing = sorted(set(self._dynamic) - {name for _, name, _, _ in found})
        if missing:
            raise ValueError(f"dynamic tables {missing} are in no module that the given sharders shard "
                             f"({[type(s).__name__ for s in sharders]})")
        return found

    def _set_optimizers(self, tables) -> None:
        """Each dynamic table's optimizer, as TorchRec merges it into the
        table's fused_params: the sharder's, overridden by one set on the
        parameter (apply_optimizer_in_backward); EXACT_SGD (the kernel's
        default) when neither says."""
        self.optimizers = {}
        for _, name, param, sharder in tables:
            optimizer = sharder_optimizer(sharder, param)
            try:
                code = optimizer_code(optimizer)
            except ValueError as e:
                raise ValueError(f"table {name!r}: {e}") from None
            override = self._optimizer_override
            if override is not None and optimizer_code(override) != code:
                raise ValueError(f"table {name!r}: the planner's optimizer={getattr(override, 'name', override)} "
                                 f"contradicts the optimizer {getattr(optimizer, 'name', optimizer)} that its sharder ({type(sharder).__name__}) trains it with")
            self.optimizers[name] = optimizer

    def _prepare(self, module, sharders):
        tables = self._dynamic_tables(module, sharders)
        self._set_optimizers(tables)
        self._reserve_dynamic_storage()
        return tables

    def _add_dynamic(self, plan: ShardingPlan, tables) -> ShardingPlan:
        world, local = self._topology.world_size, self._topology.local_world_size
        device_type = self._topology.compute_device
        for path, name, param, sharder in tables:
            ps = row_wise(compute_kernel=CUSTOMIZED)(param, local, world, device_type, sharder)
            c = self._dynamic[name]
            # The constraints' kernel settings travel as TorchRec's planner
            # passes them for native tables (TorchRec adds them to the
            # table's fused_params, which the kernel reads or refuses).
            plan.plan.setdefault(path, EmbeddingModuleShardingPlan())[name] = DynamicEmbParameterSharding(
                sharding_type=ps.sharding_type, compute_kernel=ps.compute_kernel, ranks=ps.ranks,
                sharding_spec=ps.sharding_spec, cache_params=c.cache_params, enforce_hbm=c.enforce_hbm,
                stochastic_rounding=c.stochastic_rounding, bounds_check_mode=c.bounds_check_mode,
                output_dtype=c.output_dtype, dynamicemb_options=self.options[name])
        return plan

    def plan(self, module: torch.nn.Module, sharders: List) -> ShardingPlan:
        tables = self._prepare(module, sharders)
        native = self._native_sharders(sharders)
        plan = self._native.plan(module, native) if self._has_native(module, native) else ShardingPlan({})
        return self._add_dynamic(plan, tables)

    def collective_plan(self, module: torch.nn.Module, sharders: List, pg: Optional[dist.ProcessGroup] = None
                        ) -> ShardingPlan:
        tables = self._prepare(module, sharders)
        native = self._native_sharders(sharders)
        if self._has_native(module, native):
            plan = self._native.collective_plan(module, native, pg if pg is not None else dist.GroupMember.WORLD)
        else:
            plan = ShardingPlan({})
        return self._add_dynamic(plan, tables)


def sharder_optimizer(sharder, param: Optional[torch.nn.Parameter] = None):
    """The optimizer a table's kernel runs with: `optimizer` of the sharder's
    fused_params, overridden by one set on the parameter with TorchRec's
    apply_optimizer_in_backward; EXACT_SGD (the kernel's default) if neither."""
    fused = dict(sharder.fused_params or {})
    kwargs = dict((getattr(param, "_optimizer_kwargs", None) or [{}])[0])
    cls = (getattr(param, "_optimizer_classes", None) or [None])[0]
    if cls is not None and "optimizer" not in kwargs:
        kwargs["optimizer"] = optimizer_type_to_emb_opt_type(cls)
    fused.update(kwargs)
    return fused.get("optimizer", EmbOptimType.EXACT_SGD)
