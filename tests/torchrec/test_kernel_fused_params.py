"""The dynamic kernel's fused_params: keys that would change the math and
that dynamicemb does not implement are refused (ValueError naming the tables
and the key), keys TorchRec adds by itself pass silently, unknown keys warn,
and weight_decay_mode reaches BatchedDynamicEmbeddingTables only when given."""
import warnings

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, CacheAlgorithm
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
)
from torchrec.modules.embedding_configs import DataType, PoolingType

import dynamicemb.shard.kernel as kernel
from dynamicemb import DynamicEmbTableOptions
from dynamicemb.optimizer import EmbOptimType
from dynamicemb.shard.parameter_sharding import OPTIONS_KEY, OptionsRef

_DTYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16}


def _config(fused, data_type=DataType.FP32):
    options = DynamicEmbTableOptions(dim=4, embedding_dtype=_DTYPES[data_type], max_capacity=128,
                                     num_embeddings=64)
    table = ShardedEmbeddingTable(name="d_table", num_embeddings=64, embedding_dim=4, data_type=data_type,
                                  feature_names=["d_feature"], local_rows=64, local_cols=4,
                                  compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL,
                                  fused_params={OPTIONS_KEY: OptionsRef(options)})
    return GroupedEmbeddingConfig(data_type=data_type, pooling=PoolingType.SUM, is_weighted=False,
                                  has_feature_processor=False,
                                  compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL,
                                  embedding_tables=[table],
                                  fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1,
                                                OPTIONS_KEY: OptionsRef(options), **fused})


def _kernel(fused, data_type=DataType.FP32):
    return kernel.BatchedDynamicEmbeddingBag(_config(fused, data_type))


@pytest.mark.parametrize("key,value,data_type", [
    ("max_norm", 1.0, DataType.FP32),
    ("stochastic_rounding", True, DataType.FP16),
    ("weights_precision", SparseType.FP16, DataType.FP32),
    ("optimizer_state_dtypes", {"momentum1": SparseType.FP16}, DataType.FP32),
    ("is_qr_tbe", True, DataType.FP32),
])
def test_math_changing_keys_are_refused(key, value, data_type):
    with pytest.raises(ValueError, match=f"d_table.*{key}"):
        _kernel({key: value}, data_type)


def test_unsupported_optimizer_names_the_tables():
    with pytest.raises(ValueError, match="d_table.*not supported"):
        _kernel({"optimizer": EmbOptimType.LARS_SGD})


def test_keys_torchrec_adds_and_harmless_values_pass_silently():
    fused = {
        # what TorchRec copies from a plan's ParameterSharding / cache params
        "cache_algorithm": CacheAlgorithm.LRU, "cache_load_factor": 0.2, "cache_reserved_memory": 0.0,
        "cache_precision": SparseType.FP32, "prefetch_pipeline": False, "enforce_hbm": False,
        "bounds_check_mode": BoundsCheckMode.WARNING, "output_dtype": SparseType.FP32,
        "__register_tbes_in_named_modules": False,
        # FBGEMM defaults that leave an fp32 table's math unchanged
        "stochastic_rounding": True, "gradient_clipping": False, "max_gradient": 1.0, "max_norm": 0.0,
        "momentum": 0.9, "eta": 0.001, "weights_precision": SparseType.FP32,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _kernel(fused)
    _kernel({"stochastic_rounding": False}, DataType.FP16)  # round-to-nearest is what we do


def test_unknown_key_warns():
    with pytest.warns(UserWarning, match="d_table.*'mystery_knob'"):
        _kernel({"mystery_knob": 1})


def test_weight_decay_mode_is_passed_only_when_given(monkeypatch):
    seen = []

    class Recorder(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()
            seen.append(kwargs)

    monkeypatch.setattr(kernel, "BatchedDynamicEmbeddingTables", Recorder)
    kernel.BatchedDynamicEmbeddingBag(_config({"weight_decay": 0.01}))
    kernel.BatchedDynamicEmbeddingBag(_config({"weight_decay": 0.01, "weight_decay_mode": WeightDecayMode.L2}))
    assert "weight_decay_mode" not in seen[0] and seen[0]["weight_decay"] == 0.01
    assert seen[1]["weight_decay_mode"] == WeightDecayMode.L2


def test_gradient_clipping_and_initial_accumulator_reach_the_module():
    # Implemented since issue 36 (FBGEMM's gradient_clipping was refused before).
    k = _kernel({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "gradient_clipping": True, "max_gradient": 0.5,
                 "initial_accumulator_value": 0.1})
    m = k._emb_module
    assert (m.gradient_clipping, m.max_gradient, m.initial_accumulator_value) == (True, 0.5, 0.1)
    with pytest.raises(ValueError, match="max_gradient must be > 0"):
        _kernel({"gradient_clipping": True, "max_gradient": 0.0})
    with pytest.raises(ValueError, match="initial_accumulator_value applies to .* not to EXACT_SGD"):
        _kernel({"initial_accumulator_value": 0.1})


def test_options_of_another_dim_are_refused():
    # A plan whose options were made for another table (as when two tables
    # shared a name): the kernel would build the table at the options' dim
    # and the collection's output would silently change width.
    config = _config({})
    config.embedding_tables[0].local_cols = 8
    with pytest.raises(ValueError, match="d_table.*dim 4, the table 8 columns"):
        kernel.BatchedDynamicEmbeddingBag(config)


def test_torch_adams_betas_become_beta1_and_beta2():
    """apply_optimizer_in_backward(torch.optim.Adam, ..., {"betas": ...}):
    TorchRec passes torch's `betas` on as given (a native TBE refuses it);
    they were an unknown key here, and Adam ran with 0.9 / 0.999."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = _kernel({"optimizer": EmbOptimType.ADAM, "betas": (0.5, 0.6)})._emb_module
    assert (m.beta1, m.beta2) == (0.5, 0.6)
    with pytest.raises(ValueError, match=r"d_table.*betas=\(0.5, 0.6\) and beta2=0.7 disagree"):
        _kernel({"optimizer": EmbOptimType.ADAM, "betas": (0.5, 0.6), "beta2": 0.7})
    with pytest.raises(ValueError, match=r"d_table.*betas=0.5 is not a pair"):
        _kernel({"optimizer": EmbOptimType.ADAM, "betas": 0.5})
