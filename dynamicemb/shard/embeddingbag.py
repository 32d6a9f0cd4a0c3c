"""EmbeddingBagCollection with dynamic tables: a drop-in sharder."""
from typing import Dict, Optional

import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from dynamicemb.shard.common import (building, check_feature_order, check_row_wise, lookups_train,
                                     register_dynamic_state, reset_tables)
from dynamicemb.shard.parameter_sharding import CUSTOMIZED
from dynamicemb.shard.sharding import DynamicRwPooledEmbeddingSharding


class ShardedDynamicEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    def __init__(self, module, table_name_to_parameter_sharding, *args, **kwargs):
        super().__init__(module, table_name_to_parameter_sharding, *args, **kwargs)
        self._divide_only_row_wise_means(table_name_to_parameter_sharding)

    def _divide_only_row_wise_means(self, plan: Dict[str, ParameterSharding]) -> None:
        """A row-wise MEAN table (every dynamic MEAN table) pools as SUM on
        each rank, and TorchRec's mean-pooling callback then divides the
        collection's output by the bag lengths, except the features of
        row-wise SUM tables. A table sharded otherwise (a native table-wise
        one beside a dynamic table) would be divided too: a SUM table's
        output silently averaged, a MEAN one's divided twice. Its features
        join the undivided ones. A feature read by a row-wise MEAN table and
        by another table cannot be divided for one and not the other (the
        callback keeps one divisor per feature): refused by name."""
        if not self._has_mean_pooling_callback:
            return
        configs = self._embedding_bag_configs
        row_wise = {c.name for c in configs
                    if plan[c.name].sharding_type in (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)}
        mean = {c.name for c in configs if c.name in row_wise and c.pooling == PoolingType.MEAN}
        divided = {f: c.name for c in configs if c.name in mean for f in c.feature_names}
        shared = sorted({(f, divided[f], c.name) for c in configs if c.name not in mean for f in c.feature_names
                         if f in divided})
        if shared:
            raise ValueError("features read by a row-wise MEAN table and by another table of the same "
                             "EmbeddingBagCollection, which TorchRec's mean pooling cannot divide for one and not "
                             "the other: " + ", ".join(f"{f!r} (MEAN table {m!r}, table {t!r})" for f, m, t in shared)
                             + "; give each table its own feature, or put them in separate collections")
        undivided = self._pooling_type_to_rs_features[PoolingType.SUM.value]
        undivided.extend(dict.fromkeys(f for c in configs if c.name not in row_wise for f in c.feature_names
                                       if f not in undivided))

    @classmethod
    def create_embedding_bag_sharding(cls, sharding_infos, env, device=None, permute_embeddings=False,
                                      qcomm_codecs_registry=None):
        if check_row_wise(sharding_infos):
            return DynamicRwPooledEmbeddingSharding(sharding_infos, env, device,
                                                    qcomm_codecs_registry=qcomm_codecs_registry)
        return super().create_embedding_bag_sharding(sharding_infos, env, device, permute_embeddings,
                                                     qcomm_codecs_registry)

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        with building(self):
            super()._initialize_torch_state(skip_registering)
        if not skip_registering:  # the dynamic tables' rows in state_dict(), for DCP (API.md §5)
            register_dynamic_state(self, "embedding_bags")

    def input_dist(self, ctx, features):
        check_feature_order(self, features)
        return super().input_dist(ctx, features)

    def reset_parameters(self) -> None:
        reset_tables(self, self._embedding_bag_configs, self.embedding_bags)

    def train(self, mode: bool = True):
        super().train(mode)
        lookups_train(self._lookups, mode)
        return self


class DynamicSharderMixin:
    """What our sharders add to TorchRec's: `shard()` builds our sharded
    collections. They offer TorchRec's own sharding types and compute kernels
    (no more, no less), so a planner enumerates native tables exactly as with
    TorchRec's sharders. Dynamic tables never go through an enumerator:
    DynamicEmbeddingShardingPlanner places them ROW_WISE / CUSTOMIZED_KERNEL
    itself, and TorchRec does not check a plan's sharding types or kernels
    against the sharder at sharding time (only its planners' enumerators
    consult `sharding_types` / `compute_kernels`)."""

    def checked_plan(self, params: Dict[str, ParameterSharding]) -> Dict[str, ParameterSharding]:
        """params, once every table planned with our kernel carries its
        DynamicEmbTableOptions: a plan made by TorchRec's planners or plan
        helpers (construct_module_sharding_plan, row_wise(...)) gives the
        kernel but not the options, which only DynamicEmbeddingShardingPlanner
        completes (per-rank capacity, memory budget, optimizer state)."""
        bare = sorted(n for n, ps in params.items()
                      if ps.compute_kernel == CUSTOMIZED and getattr(ps, "dynamicemb_options", None) is None)
        if bare:
            raise ValueError(f"tables {bare} are planned with compute kernel {CUSTOMIZED!r} but carry no "
                             f"DynamicEmbTableOptions: plan dynamic tables with "
                             f"dynamicemb.planner.DynamicEmbeddingShardingPlanner (TorchRec's planners and plan "
                             f"helpers such as construct_module_sharding_plan do not make a table dynamic)")
        return params

    def planning_sharder(self, exclude=()):
        """A TorchRec sharder (the stock class this one extends, same state:
        fused_params, qcomm codecs, ...) for planning native tables; its
        `shardable_parameters` leaves out the tables named in `exclude`."""
        return _planning_sharder(self, frozenset(exclude))


def _stock_class(sharder) -> type:
    for cls in type(sharder).__mro__:
        if not issubclass(cls, DynamicSharderMixin) and cls.__module__.startswith("torchrec."):
            return cls
    raise TypeError(f"{type(sharder).__name__} extends no TorchRec sharder")


def _planning_sharder(sharder, exclude: frozenset):
    stock = _stock_class(sharder)
    out = stock.__new__(stock)  # the sharder's state in TorchRec's class
    out.__dict__.update(sharder.__dict__)
    params = out.shardable_parameters
    out.shardable_parameters = lambda module: {n: p for n, p in params(module).items() if n not in exclude}
    return out


class DynamicEmbeddingBagCollectionSharder(DynamicSharderMixin, EmbeddingBagCollectionSharder):
    """Drop-in for EmbeddingBagCollectionSharder: dynamic tables (planned by
    DynamicEmbeddingShardingPlanner) get our kernel, the others TorchRec's.
    The optimizer and its hyper-parameters come from `fused_params`."""

    def shard(self, module: EmbeddingBagCollection, params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None):
        return ShardedDynamicEmbeddingBagCollection(
            module=module, table_name_to_parameter_sharding=self.checked_plan(params), env=env,
            fused_params=self.fused_params, device=device, qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn, sharded_module_order_overwrite=self._sharded_module_order_overwrite)

    @property
    def sharded_module_type(self):
        return ShardedDynamicEmbeddingBagCollection
