"""TorchRec compute kernels (BaseEmbedding) over BatchedDynamicEmbeddingTables:
one per group of dynamic tables of a sharding, built by the lookups of
dynamicemb.shard.sharding for CUSTOMIZED_KERNEL groups."""
from collections import OrderedDict
from typing import Optional

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import SparseType
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import pooling_type_to_pooling_mode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb.batched_dynamicemb_tables import BatchedDynamicEmbeddingTables
from dynamicemb.optimizer import EmbOptimType
from dynamicemb.shard.parameter_sharding import init_stream, table_options
from dynamicemb.types import DynamicEmbPoolingMode

# fused_params TorchRec users already pass to FUSED tables, and our extras.
_HYPER = ("learning_rate", "eps", "beta1", "beta2", "weight_decay")


def _output_dtype(fused_params) -> torch.dtype:
    dt = fused_params.get("output_dtype", SparseType.FP32)
    return dt.as_dtype() if isinstance(dt, SparseType) else dt


class _DynamicKernel(BaseEmbedding):
    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup],
                 device: Optional[torch.device], pooling) -> None:
        super().__init__()
        self._config = config
        self._pg = pg
        fused = dict(config.fused_params or {})
        tables = config.embedding_tables
        options = []
        for t in tables:
            o = table_options(t)
            if o is None:
                raise ValueError(f"table {t.name!r} is planned with CUSTOMIZED_KERNEL but has no dynamicemb "
                                 f"options; plan it with DynamicEmbeddingShardingPlanner")
            options.append(o)
        self._emb_module = BatchedDynamicEmbeddingTables(
            options,
            table_names=[t.name for t in tables],
            feature_table_map=[i for i, t in enumerate(tables) for _ in range(t.num_features())],
            pooling_mode=pooling,
            optimizer=fused.get("optimizer", EmbOptimType.EXACT_SGD),
            output_dtype=_output_dtype(fused),
            device=device,
            seed=int(fused.get("dynamicemb_seed", 0)),
            init_streams=[init_stream(t.name) for t in tables],
            **{k: fused[k] for k in _HYPER if k in fused},
        )

    @property
    def config(self) -> GroupedEmbeddingConfig:
        return self._config

    @property
    def emb_module(self) -> BatchedDynamicEmbeddingTables:
        return self._emb_module

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        weights = features.weights_or_none()
        if weights is not None and not torch.is_floating_point(weights):
            weights = None
        return self._emb_module(features.values(), features.offsets(), weights)

    # TorchRec calls these on every kernel; dynamic tables need no cache flush.
    def flush(self) -> None:
        pass

    def purge(self) -> None:
        pass

    # The rows live in the kernel's storage, not in parameters: TorchRec's
    # state_dict, parameter lists and dense optimizers leave them out
    # (checkpoints: DynamicEmbDump / DynamicEmbLoad).
    def state_dict(self, destination=None, prefix="", keep_vars=False):
        return destination if destination is not None else OrderedDict()

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        return iter(())

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        return iter(())

    def named_parameters_by_table(self):
        return iter(())


class BatchedDynamicEmbeddingBag(_DynamicKernel):
    """Pooled (EmbeddingBagCollection) dynamic tables. Row-wise MEAN pools as
    SUM here; TorchRec divides after the output reduce-scatter."""

    def __init__(self, config, pg=None, device=None, sharding_type: Optional[ShardingType] = None):
        mode = pooling_type_to_pooling_mode(config.pooling, sharding_type)
        super().__init__(config, pg, device, DynamicEmbPoolingMode[mode.name])


class BatchedDynamicEmbedding(_DynamicKernel):
    """Sequence (EmbeddingCollection) dynamic tables: one row per id."""

    def __init__(self, config, pg=None, device=None):
        super().__init__(config, pg, device, DynamicEmbPoolingMode.NONE)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        # Sequence lookups have no per-sample weights (TorchRec's own
        # sequence kernels ignore them too).
        return self._emb_module(features.values(), features.offsets())
