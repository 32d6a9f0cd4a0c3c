"""Planning collections with dynamic tables (API.md §2).

Dynamic tables are planned ROW_WISE over all ranks with CUSTOMIZED_KERNEL and
our own storage estimate (their per-rank values and optimizer state, plus the
hash table); TorchRec's planner plans the native tables unchanged, on a
topology whose memory is reduced by what the dynamic tables take.
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import row_wise
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType

from dynamicemb.optimizer import EmbOptimType, optimizer_code, state_width
from dynamicemb.options import DynamicEmbTableOptions
from dynamicemb.shard.embeddingbag import _DynamicSharderMixin
from dynamicemb.shard.parameter_sharding import CUSTOMIZED, DynamicEmbParameterSharding

_DTYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}
# Hash table bytes per slot: key (8), score (8), digest (1), epoch (4).
_TABLE_BYTES_PER_SLOT = 21


@dataclass
class DynamicEmbParameterConstraints(ParameterConstraints):
    """ParameterConstraints that can make a table dynamic."""

    use_dynamicemb: bool = False
    dynamicemb_options: DynamicEmbTableOptions = field(default_factory=DynamicEmbTableOptions)


def get_sharded_table_capacity(num_embeddings: int, world_size: int, bucket_capacity: int = 128) -> int:
    """Rows per rank of a dynamic table of `num_embeddings` rows over
    `world_size` ranks: ceil(num_embeddings / world_size), in whole buckets."""
    if num_embeddings <= 0 or world_size <= 0:
        raise ValueError(f"num_embeddings ({num_embeddings}) and world_size ({world_size}) must be positive")
    rows = -(-num_embeddings // world_size)
    return -(-rows // bucket_capacity) * bucket_capacity


def get_table_value_bytes(capacity: int, dim: int, embedding_dtype: torch.dtype = torch.float32,
                          optimizer=EmbOptimType.EXACT_SGD, training: bool = True) -> int:
    """Bytes of a table's values and optimizer state at `capacity` rows."""
    width = dim + (state_width(optimizer_code(optimizer), dim) if training else 0)
    return capacity * width * torch.empty((), dtype=embedding_dtype).element_size()


def complete_options(config: BaseEmbeddingConfig, options: DynamicEmbTableOptions, world_size: int
                     ) -> DynamicEmbTableOptions:
    """The per-rank options of a table: dim, dtype, capacity and initializer
    bounds from the TorchRec config. Refuses options contradicting it."""
    name = config.name
    dtype = _DTYPES.get(config.data_type)
    if dtype is None:
        raise ValueError(f"table {name!r}: data_type {config.data_type} is not supported by dynamic tables")
    if options.dim is not None and options.dim != config.embedding_dim:
        raise ValueError(f"table {name!r}: dynamicemb_options.dim={options.dim} contradicts the table's "
                         f"embedding_dim={config.embedding_dim}")
    if options.embedding_dtype is not None and options.embedding_dtype != dtype:
        raise ValueError(f"table {name!r}: dynamicemb_options.embedding_dtype={options.embedding_dtype} "
                         f"contradicts the table's data_type={config.data_type}")
    if options.num_embeddings is not None and options.num_embeddings != config.num_embeddings:
        raise ValueError(f"table {name!r}: dynamicemb_options.num_embeddings={options.num_embeddings} contradicts "
                         f"the table's num_embeddings={config.num_embeddings}")
    max_cap = options.max_capacity or get_sharded_table_capacity(config.num_embeddings, world_size,
                                                                 options.bucket_capacity)
    out = dataclasses.replace(options, dim=config.embedding_dim, embedding_dtype=dtype, max_capacity=max_cap,
                              num_embeddings=config.num_embeddings, num_shards=world_size)
    out.validate(name)
    return out


class DynamicEmbeddingShardingPlanner:
    """Plans dynamic tables ROW_WISE / CUSTOMIZED_KERNEL and delegates the
    native tables to TorchRec's EmbeddingShardingPlanner (extra keyword
    arguments go to it)."""

    def __init__(self, eb_configs: Sequence[BaseEmbeddingConfig], topology: Optional[Topology] = None,
                 batch_size: Optional[int] = None, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 optimizer=EmbOptimType.EXACT_SGD, **kwargs):
        self._configs = {c.name: c for c in eb_configs}
        constraints = dict(constraints or {})
        self._dynamic = {n: c for n, c in constraints.items()
                         if isinstance(c, DynamicEmbParameterConstraints) and c.use_dynamicemb}
        for name, c in self._dynamic.items():
            if name not in self._configs:
                raise ValueError(f"constraints name table {name!r}, which is not among the eb_configs")
            if c.sharding_types and c.sharding_types != [ShardingType.ROW_WISE.value]:
                raise ValueError(f"table {name!r}: dynamic tables are sharded ROW_WISE only, "
                                 f"constraints ask for {c.sharding_types}")
        native = {n: c for n, c in constraints.items() if n not in self._dynamic}
        self._native = EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=native,
                                                **kwargs)
        self._topology = self._native._topology
        self._optimizer = optimizer
        self.options = {n: complete_options(self._configs[n], c.dynamicemb_options, self._topology.world_size)
                        for n, c in self._dynamic.items()}
        self._reserve_dynamic_storage()

    # ---- storage -----------------------------------------------------------------------

    def dynamic_bytes_per_rank(self) -> Dict[str, int]:
        """Our storage estimate of each dynamic table on one rank: values and
        optimizer state at max_capacity plus the hash table."""
        return {n: self._value_bytes(o) + o.max_capacity * _TABLE_BYTES_PER_SLOT for n, o in self.options.items()}

    def _value_bytes(self, o: DynamicEmbTableOptions) -> int:
        return get_table_value_bytes(o.max_capacity, o.dim, o.embedding_dtype, self._optimizer, o.training)

    def _reserve_dynamic_storage(self) -> None:
        """Takes our tables' bytes out of every rank's budget: on a CUDA
        topology the hash tables and the values that fit global_hbm_for_values
        from HBM, the other values (the host tier) from DDR."""
        on_device = self._topology.compute_device == "cuda"
        hbm = ddr = 0
        for o in self.options.values():
            values, table = self._value_bytes(o), o.max_capacity * _TABLE_BYTES_PER_SLOT
            if not on_device:
                ddr += values + table
            elif o.values_on_device(values):
                hbm += values + table
            else:
                hbm, ddr = hbm + table, ddr + values
        for d in self._topology.devices:
            for kind, need, have in (("HBM", hbm, d.storage.hbm), ("DDR", ddr, d.storage.ddr)):
                if need > have:
                    raise ValueError(f"dynamic tables need {need} bytes of {kind} per rank "
                                     f"({self.dynamic_bytes_per_rank()}), more than rank {d.rank} has ({have} bytes)")
            d.storage.hbm -= hbm
            d.storage.ddr -= ddr

    # ---- plans -------------------------------------------------------------------------

    def _native_sharders(self, sharders):
        """The sharders TorchRec's planner plans the native tables with: ours
        become the stock TorchRec sharders they extend (same fused_params),
        blind to the dynamic tables, so native tables get exactly the plan
        that TorchRec's sharders would give them."""
        exclude = frozenset(self._dynamic)
        return [s.planning_sharder(exclude) if isinstance(s, _DynamicSharderMixin) else s for s in sharders]

    def _has_native(self, module, sharders) -> bool:
        by_type = {s.module_type: s for s in sharders}
        return any(type(m) in by_type and by_type[type(m)].shardable_parameters(m)
                   for _, m in module.named_modules())

    def _add_dynamic(self, plan: ShardingPlan, module, sharders) -> ShardingPlan:
        by_type = {s.module_type: s for s in sharders}
        world, local = self._topology.world_size, self._topology.local_world_size
        device_type = self._topology.compute_device
        for path, m in module.named_modules():
            sharder = by_type.get(type(m))
            if sharder is None:
                continue
            for name, param in sharder.shardable_parameters(m).items():
                if name not in self._dynamic:
                    continue
                if not isinstance(sharder, _DynamicSharderMixin):
                    raise ValueError(f"table {name!r} is dynamic but module {path or '<root>'!r} is sharded by "
                                     f"{type(sharder).__name__}; use dynamicemb.shard's sharders")
                ps = row_wise(compute_kernel=CUSTOMIZED)(param, local, world, device_type, sharder)
                plan.plan.setdefault(path, EmbeddingModuleShardingPlan())[name] = DynamicEmbParameterSharding(
                    sharding_type=ps.sharding_type, compute_kernel=ps.compute_kernel, ranks=ps.ranks,
                    sharding_spec=ps.sharding_spec, dynamicemb_options=self.options[name])
        return plan

    def plan(self, module: torch.nn.Module, sharders: List) -> ShardingPlan:
        native = self._native_sharders(sharders)
        plan = self._native.plan(module, native) if self._has_native(module, native) else ShardingPlan({})
        return self._add_dynamic(plan, module, sharders)

    def collective_plan(self, module: torch.nn.Module, sharders: List, pg: Optional[dist.ProcessGroup] = None
                        ) -> ShardingPlan:
        native = self._native_sharders(sharders)
        if self._has_native(module, native):
            plan = self._native.collective_plan(module, native, pg if pg is not None else dist.GroupMember.WORLD)
        else:
            plan = ShardingPlan({})
        return self._add_dynamic(plan, module, sharders)
