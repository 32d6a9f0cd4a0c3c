"""TorchRec compute kernels (BaseEmbedding) over BatchedDynamicEmbeddingTables:
one per group of dynamic tables of a sharding, built by the lookups of
dynamicemb.shard.sharding for CUSTOMIZED_KERNEL groups."""
import warnings
from collections import OrderedDict
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import SparseType
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import DataType, data_type_to_dtype, pooling_type_to_pooling_mode
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb import rules
from dynamicemb.batched_dynamicemb_tables import BatchedDynamicEmbeddingTables
from dynamicemb.contiguous import contiguous_as
from dynamicemb.optimizer import EmbOptimType, optimizer_code
from dynamicemb.shard import vbe as vbe_layout
from dynamicemb.shard.fused_optimizer import DynamicEmbFusedOptimizer
from dynamicemb.shard.parameter_sharding import OPTIONS_KEY, init_stream, table_options
from dynamicemb.types import DynamicEmbPoolingMode

# fused_params TorchRec users already pass to FUSED tables (FBGEMM's
# hyper-parameters; weight_decay_mode: its WeightDecayMode or int, NONE when
# absent; FBGEMM's gradient clipping; torch's Adagrad initial accumulator),
# and our extras.
_HYPER = rules.HYPER_PARAMETERS + ("gradient_clipping", "max_gradient", "initial_accumulator_value")
# What the kernel reads from fused_params.
_USED = frozenset(_HYPER + ("optimizer", "output_dtype", "dynamicemb_seed", OPTIONS_KEY))
# Keys with no effect on what a dynamic table computes: FBGEMM's cache,
# placement, prefetch, index-type, bounds-check and stats settings (TorchRec
# adds some itself from the plan: cache_*, prefetch_pipeline, enforce_hbm,
# bounds_check_mode, output_dtype), TorchRec's own bookkeeping, and
# hyper-parameters that FBGEMM itself reads only for optimizers we do not
# implement (momentum, eta).
_NO_EFFECT = frozenset((
    "cache_algorithm", "cache_load_factor", "cache_sets", "cache_reserved_memory", "cache_precision",
    "enforce_hbm", "record_cache_metrics", "gather_uvm_cache_stats", "prefetch_pipeline",
    "multipass_prefetch_config", "stats_reporter_config", "uvm_non_rowwise_momentum", "use_experimental_tbe",
    "uvm_host_mapped", "bounds_check_mode", "embedding_table_index_type", "embedding_table_offset_type",
    "tbe_input_multiplexer_config", "embedding_shard_info", "preallocated_host_buffers", "table_names",
    "use_one_tbe_per_table", "_batch_key", "momentum", "eta",
))
_FP32_ONLY = "only matters for float16 / bfloat16 rows, which dynamicemb rounds to nearest"
# Keys of FBGEMM's TBE that change the math, with the values that do not:
# (key, harmless(value, tables) -> bool, what it does).
_REFUSED = (
    ("max_norm", lambda v, t: not v, "row max-norm renormalization"),
    ("stochastic_rounding", lambda v, t: not v or all(_dtype(x) == torch.float32 for x in t), _FP32_ONLY),
    ("weights_precision", lambda v, t: all(_sparse_dtype(v) == _dtype(x) for x in t),
     "a storage precision other than the table's data_type"),
    ("optimizer_state_dtypes", lambda v, t: not v, "optimizer state in another precision"),
    ("ensemble_mode", lambda v, t: v is None, "ensemble optimizers"),
    ("emainplace_mode", lambda v, t: v is None, "EMA in-place optimizers"),
    ("counter_based_regularization", lambda v, t: v is None, "counter-based regularization"),
    ("cowclip_regularization", lambda v, t: v is None, "CowClip regularization"),
    ("global_weight_decay", lambda v, t: v is None, "global weight decay"),
    ("extra_optimizer_config", lambda v, t: v is None, "extra optimizer configuration"),
    ("is_qr_tbe", lambda v, t: not v, "quotient-remainder tables"),
    ("enable_raw_embedding_streaming", lambda v, t: not v, "raw embedding streaming"),
    ("res_params", lambda v, t: v is None, "raw embedding streaming"),
)


def _dtype(table) -> torch.dtype:
    return data_type_to_dtype(table.data_type)


def _sparse_dtype(v):
    return v.as_dtype() if isinstance(v, SparseType) else (data_type_to_dtype(v) if isinstance(v, DataType) else v)


def check_fused_params(fused: Dict[str, Any], tables: Sequence) -> None:
    """Refuses (ValueError naming the tables and the key) fused_params that
    would change what FBGEMM computes and that dynamicemb does not implement;
    warns about keys it does not know. Keys TorchRec adds by itself (cache,
    prefetch, bounds-check, output dtype, its internal `__register_*` keys)
    pass."""
    names = [t.name for t in tables]
    try:
        optimizer_code(fused.get("optimizer", EmbOptimType.EXACT_SGD))
    except ValueError as e:
        raise ValueError(f"dynamic tables {names}: {e}") from None
    refused = {key: (ok, what) for key, ok, what in _REFUSED}
    for key, value in fused.items():
        if key in _USED or key in _NO_EFFECT or key.startswith("__register"):
            continue
        if key in refused:
            ok, what = refused[key]
            if not ok(value, tables):
                raise ValueError(f"dynamic tables {names}: fused_params {key}={value!r} ({what}) is not "
                                 f"implemented by dynamicemb; remove it from the sharder's fused_params")
            continue
        warnings.warn(f"dynamic tables {names}: fused_params key {key!r} is unknown to dynamicemb and has no "
                      f"effect on these tables", stacklevel=3)


def torch_names(fused: Dict[str, Any], tables: Sequence) -> Dict[str, Any]:
    """fused_params with torch.optim's `betas` (set on a parameter with
    apply_optimizer_in_backward(torch.optim.Adam, ..., {"betas": ...}),
    which TorchRec passes on as given) as FBGEMM's beta1 / beta2."""
    if "betas" not in fused:
        return fused
    out = dict(fused)
    betas = out.pop("betas")
    names = [t.name for t in tables]
    try:
        beta1, beta2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise ValueError(f"dynamic tables {names}: betas={betas!r} is not a pair of numbers (beta1, beta2)") from None
    for key, value in (("beta1", beta1), ("beta2", beta2)):
        if key in out and float(out[key]) != value:
            raise ValueError(f"dynamic tables {names}: betas={betas!r} and {key}={out[key]!r} disagree")
        out[key] = value
    return out


def _output_dtype(fused_params) -> torch.dtype:
    dt = fused_params.get("output_dtype", SparseType.FP32)
    return dt.as_dtype() if isinstance(dt, SparseType) else dt


def _user_pooling(table, kernel_pooling) -> str:
    """The pooling the user gave the table (a row-wise MEAN table pools as
    SUM in the kernel; TorchRec divides later)."""
    if kernel_pooling == DynamicEmbPoolingMode.NONE:
        return "NONE"
    return table.pooling.name


class _DynamicKernel(BaseEmbedding, FusedOptimizerModule):
    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup],
                 device: Optional[torch.device], pooling) -> None:
        super().__init__()
        self._config = config
        self._pg = pg
        tables = config.embedding_tables
        fused = torch_names(dict(config.fused_params or {}), tables)
        check_fused_params(fused, tables)
        extra = {k: fused[k] for k in _HYPER if k in fused}
        options = []
        for t in tables:
            o = table_options(t)
            if o is None:
                raise ValueError(f"table {t.name!r} is planned with CUSTOMIZED_KERNEL but has no dynamicemb "
                                 f"options; plan it with DynamicEmbeddingShardingPlanner")
            if o.dim != t.local_cols:  # a plan made for another table (ROW_WISE: every rank holds whole rows)
                raise ValueError(f"table {t.name!r}: its plan's options have dim {o.dim}, the table "
                                 f"{t.local_cols} columns")
            if o.num_embeddings is not None and o.num_embeddings != t.num_embeddings:  # (its capacity, bounds, routing)
                raise ValueError(f"table {t.name!r}: its plan's options have num_embeddings {o.num_embeddings}, the "
                                 f"table {t.num_embeddings} (plan with the module's own table configs)")
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
            feature_names=[t.feature_names for t in tables],
            table_poolings=[_user_pooling(t, pooling) for t in tables],
            **extra,
        )
        self._emb_module.is_weighted = bool(config.is_weighted)
        self._emb_module.shard_ranks = (tuple(dist.get_process_group_ranks(pg))
                                        if pg is not None and dist.is_initialized() else None)
        # Whether TorchRec's prefetch pipelines must prefetch this group (see prefetch()).
        self.needs_prefetch = any(o.caching for o in options)
        self._optim: Optional[DynamicEmbFusedOptimizer] = None
        # Each feature's dim, in the features' order (a VBE output's blocks).
        self._feature_dims = [t.local_cols for t in tables for _ in range(t.num_features())]

    @property
    def config(self) -> GroupedEmbeddingConfig:
        return self._config

    @property
    def emb_module(self) -> BatchedDynamicEmbeddingTables:
        return self._emb_module

    @property
    def fused_optimizer(self) -> DynamicEmbFusedOptimizer:
        """This group's entry in model.fused_optimizer (TorchRec collects it
        when it builds the sharded collection): LR schedules reach these
        tables as they reach FUSED ones."""
        if self._optim is None:
            self._optim = DynamicEmbFusedOptimizer(self._emb_module)
        return self._optim

    def forward(self, features: KeyedJaggedTensor, vbe_output_offsets: Optional[torch.Tensor] = None,
                vbe_output: Optional[torch.Tensor] = None) -> torch.Tensor:
        weights = features.weights_or_none()
        if weights is not None and not torch.is_floating_point(weights):
            weights = None
        if not features.variable_stride_per_key():
            return self._emb_module(features.values(), features.offsets(), weights)
        # VBE (vbe.py): pooled over the bags padded to one count, then laid
        # out as TorchRec's VBE output (into vbe_output when several kernels share it).
        pooled = self._emb_module(features.values(), self._vbe_offsets(features), weights)
        return vbe_layout.vbe_output(pooled, features.stride_per_key_per_rank(), self._feature_dims,
                                     vbe_output_offsets, vbe_output)

    @staticmethod
    def _vbe_offsets(features: KeyedJaggedTensor) -> torch.Tensor:
        return vbe_layout.padded_offsets(contiguous_as(features.lengths(), torch.int64), features.stride_per_key())

    def prefetch(self, features: KeyedJaggedTensor, forward_stream=None) -> None:
        """Moves the rows of a coming batch's keys (this rank's, after the
        input distribution) from the backing store into the cache of the
        group's cached tables; our lookups call it from TorchRec's prefetch."""
        offsets = self._vbe_offsets(features) if features.variable_stride_per_key() else features.offsets()
        self._emb_module.prefetch(features.values(), offsets, forward_stream)

    # TorchRec calls flush() before every state_dict() (its pre-hook) and
    # purge() before load_state_dict(); neither concerns dynamic tables, which
    # are not in the state_dict. In particular flush() does not write the
    # caches back: a row lives in exactly one tier, so that would empty every
    # cache at each state_dict() (and could run between a forward and its
    # backward). Dumps read both tiers; BatchedDynamicEmbeddingTables.flush()
    # writes a cache back explicitly.
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
