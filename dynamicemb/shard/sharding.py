"""Row-wise shardings with dynamic tables: TorchRec's RW shardings, with our
input distribution (per-feature routing) and lookups that build our kernel for
CUSTOMIZED_KERNEL groups and TorchRec's kernels for the other tables."""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb.routing import ROUTE_BLOCK, route_param, route_rule
from dynamicemb.shard.input_dist import DynamicRwSparseFeaturesDist
from dynamicemb.shard.kernel import BatchedDynamicEmbedding, BatchedDynamicEmbeddingBag, _DynamicKernel
from dynamicemb.shard.parameter_sharding import table_options
from dynamicemb.shard.vbe import DynamicRwPooledEmbeddingDist

_CUSTOM = EmbeddingComputeKernel.CUSTOMIZED_KERNEL


def _prefetch_cached_groups(lookup, sparse_features: KeyedJaggedTensor, forward_stream) -> None:
    """Our kernel's prefetch for the lookup's groups with cached dynamic
    tables (TorchRec's lookups prefetch only the compute kernels they know)."""
    groups = [i for i, m in enumerate(lookup._emb_modules) if isinstance(m, _DynamicKernel) and m.needs_prefetch]
    if groups:
        features = sparse_features.split(lookup._feature_splits)
        for i in groups:
            lookup._emb_modules[i].prefetch(features[i], forward_stream)


class DynamicGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    def _create_embedding_kernel(self, config, device, pg, sharding_type, env):
        if config.compute_kernel == _CUSTOM:
            return BatchedDynamicEmbeddingBag(config=config, pg=pg, device=device, sharding_type=sharding_type)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)

    def prefetch(self, sparse_features: KeyedJaggedTensor, forward_stream=None) -> None:
        _prefetch_cached_groups(self, sparse_features, forward_stream)
        super().prefetch(sparse_features, forward_stream)  # native groups (it passes over ours)


class DynamicGroupedEmbeddingsLookup(GroupedEmbeddingsLookup):
    def _create_embedding_kernel(self, config, pg, device, env=None):
        if config.compute_kernel == _CUSTOM:
            return BatchedDynamicEmbedding(config=config, pg=pg, device=device)
        return super()._create_embedding_kernel(config, pg, device, env)

    def prefetch(self, sparse_features: KeyedJaggedTensor, forward_stream=None) -> None:
        if self._need_prefetch:  # a native table needs it: TorchRec prefetches every group, ours included
            super().prefetch(sparse_features, forward_stream)
        else:
            _prefetch_cached_groups(self, sparse_features, forward_stream)


class _DynamicRoutingMixin:
    """Per-feature routing rules, in the feature order of the sharding."""

    def _routing(self) -> Tuple[List[int], List[int]]:
        world = self._world_size
        rules, params = [], []
        for config in self._grouped_embedding_configs:
            for table in config.embedding_tables:
                o = table_options(table)
                if o is None:  # native row-wise table: TorchRec's block rule
                    rule, param = ROUTE_BLOCK, (table.num_embeddings + world - 1) // world
                else:
                    rule = route_rule(o.dist_type, table.name)
                    param = route_param(o.dist_type, table.num_embeddings)
                rules += [rule] * table.num_features()
                params += [param] * table.num_features()
        return rules, params

    def _input_dist(self, device, is_sequence: bool) -> DynamicRwSparseFeaturesDist:
        rules, params = self._routing()
        return DynamicRwSparseFeaturesDist(
            pg=self._pg, num_features=self._get_num_features(), feature_hash_sizes=self._get_feature_hash_sizes(),
            rules=rules, params=params, device=device if device is not None else self._device,
            is_sequence=is_sequence, has_feature_processor=self._has_feature_processor)


class DynamicRwPooledEmbeddingSharding(_DynamicRoutingMixin, RwPooledEmbeddingSharding):
    def create_input_dist(self, device: Optional[torch.device] = None):
        return self._input_dist(device, is_sequence=False)

    def create_output_dist(self, device: Optional[torch.device] = None):
        return DynamicRwPooledEmbeddingDist(self._pg, qcomm_codecs_registry=self.qcomm_codecs_registry,
                                            embedding_dims=self.embedding_dims())

    def create_lookup(self, device=None, fused_params: Optional[Dict[str, Any]] = None, feature_processor=None):
        return DynamicGroupedPooledEmbeddingsLookup(
            grouped_configs=self._grouped_embedding_configs, pg=self._pg,
            device=device if device is not None else self._device, feature_processor=feature_processor,
            sharding_type=ShardingType.ROW_WISE, env=self._env)


class DynamicRwSequenceEmbeddingSharding(_DynamicRoutingMixin, RwSequenceEmbeddingSharding):
    def create_input_dist(self, device: Optional[torch.device] = None):
        return self._input_dist(device, is_sequence=True)

    def create_lookup(self, device=None, fused_params: Optional[Dict[str, Any]] = None, feature_processor=None):
        return DynamicGroupedEmbeddingsLookup(
            grouped_configs=self._grouped_embedding_configs, pg=self._pg,
            device=device if device is not None else self._device, env=self._env)
