"""EmbeddingBagCollection with dynamic tables: a drop-in sharder."""
from typing import Dict, List, Optional

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from dynamicemb.shard.common import check_row_wise, lookups_train, reset_native_parameters
from dynamicemb.shard.sharding import DynamicRwPooledEmbeddingSharding


class ShardedDynamicEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    @classmethod
    def create_embedding_bag_sharding(cls, sharding_infos, env, device=None, permute_embeddings=False,
                                      qcomm_codecs_registry=None):
        if check_row_wise(sharding_infos):
            return DynamicRwPooledEmbeddingSharding(sharding_infos, env, device,
                                                    qcomm_codecs_registry=qcomm_codecs_registry)
        return super().create_embedding_bag_sharding(sharding_infos, env, device, permute_embeddings,
                                                     qcomm_codecs_registry)

    def reset_parameters(self) -> None:
        reset_native_parameters(self, self._embedding_bag_configs, self.embedding_bags)

    def train(self, mode: bool = True):
        super().train(mode)
        lookups_train(self._lookups, mode)
        return self


class _DynamicSharderMixin:
    """ROW_WISE on every device. While planning, the planner hides dynamic
    tables from TorchRec's planner (`_planning_exclude`) and places them
    itself; CUSTOMIZED_KERNEL is never offered to a planner's enumerator
    (TorchRec's estimators reject it, which broke planning native tables)."""

    _planning_exclude: frozenset = frozenset()

    def shardable_parameters(self, module):
        params = super().shardable_parameters(module)
        return {n: p for n, p in params.items() if n not in self._planning_exclude}

    def sharding_types(self, compute_device_type: str) -> List[str]:
        types = list(super().sharding_types(compute_device_type))
        if ShardingType.ROW_WISE.value not in types:
            types.append(ShardingType.ROW_WISE.value)
        return types

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        kernels = list(super().compute_kernels(sharding_type, compute_device_type))
        if compute_device_type == "cpu" and EmbeddingComputeKernel.FUSED.value not in kernels:
            kernels.append(EmbeddingComputeKernel.FUSED.value)  # TorchRec's fused CPU kernels work RW too
        return kernels


class DynamicEmbeddingBagCollectionSharder(_DynamicSharderMixin, EmbeddingBagCollectionSharder):
    """Drop-in for EmbeddingBagCollectionSharder: dynamic tables (planned by
    DynamicEmbeddingShardingPlanner) get our kernel, the others TorchRec's.
    The optimizer and its hyper-parameters come from `fused_params`."""

    def shard(self, module: EmbeddingBagCollection, params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None):
        return ShardedDynamicEmbeddingBagCollection(
            module=module, table_name_to_parameter_sharding=params, env=env, fused_params=self.fused_params,
            device=device, qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn)

    @property
    def sharded_module_type(self):
        return ShardedDynamicEmbeddingBagCollection
