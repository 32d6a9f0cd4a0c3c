"""EmbeddingCollection (sequence) with dynamic tables: a drop-in sharder."""
import warnings
from typing import Dict, Optional

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingCollection

from dynamicemb.shard.common import (building, check_feature_order, check_row_wise, lookups_train,
                                     register_dynamic_state, reset_tables)
from dynamicemb.shard.embeddingbag import DynamicSharderMixin
from dynamicemb.shard.sharding import DynamicRwSequenceEmbeddingSharding


class ShardedDynamicEmbeddingCollection(ShardedEmbeddingCollection):
    @classmethod
    def create_embedding_sharding(cls, sharding_type, sharding_infos, env, device=None,
                                  qcomm_codecs_registry=None):
        if check_row_wise(sharding_infos):
            return DynamicRwSequenceEmbeddingSharding(sharding_infos=sharding_infos, env=env, device=device,
                                                      qcomm_codecs_registry=qcomm_codecs_registry)
        return super().create_embedding_sharding(sharding_type, sharding_infos, env, device, qcomm_codecs_registry)

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        with building(self):
            super()._initialize_torch_state(skip_registering)
        if not skip_registering:  # the dynamic tables' rows in state_dict(), for DCP (API.md §5)
            register_dynamic_state(self, "embeddings")

    def input_dist(self, ctx, features):
        check_feature_order(self, features)
        return super().input_dist(ctx, features)

    def reset_parameters(self) -> None:
        reset_tables(self, self._embedding_configs, self.embeddings)

    def train(self, mode: bool = True):
        super().train(mode)
        lookups_train(self._lookups, mode)
        return self


class DynamicEmbeddingCollectionSharder(DynamicSharderMixin, EmbeddingCollectionSharder):
    """Drop-in for EmbeddingCollectionSharder (see the EBC sharder)."""

    def shard(self, module: EmbeddingCollection, params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None):
        dedup = getattr(self, "_use_index_dedup", False)
        if dedup and (device is None or torch.device(device).type == "cpu"):
            # TorchRec's index dedup runs fbgemm's jagged_unique_indices, a CUDA-only op: on the CPU the
            # first forward failed. A dynamic table deduplicates its ids itself.
            warnings.warn("DynamicEmbeddingCollectionSharder: use_index_dedup=True is ignored on the CPU (TorchRec's "
                          "index dedup runs a CUDA-only fbgemm op; dynamic tables deduplicate their ids anyway)",
                          UserWarning, stacklevel=2)
            dedup = False
        return ShardedDynamicEmbeddingCollection(
            module=module, table_name_to_parameter_sharding=self.checked_plan(params), env=env,
            fused_params=self.fused_params, device=device, qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn, use_index_dedup=dedup)

    @property
    def sharded_module_type(self):
        return ShardedDynamicEmbeddingCollection
