"""Every DynamicEmbTableOptions field is checked when the options are built
(issue 35 §2), naming the field and the value; fields the planner fills in
later (dim, max_capacity, num_embeddings) may be None until validate(name),
which checks all again and names the table."""
import warnings

import pytest
import torch

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbInitializerArgs, DynamicEmbScoreStrategy,
                        DynamicEmbTableOptions, EmbOptimType)
from dynamicemb.options import FrequencyAdmissionStrategy, KVCounter
from emb_helpers import make_module

BAD_OPTIONS = [
    (dict(dist_type="foo"), "unknown dist_type 'foo'; use 'hash_roundrobin', 'roundrobin' or 'continuous'"),
    (dict(dim=0), "dim must be a positive int, got 0"),
    (dict(dim=4.0), "dim must be a positive int, got 4.0"),
    (dict(max_capacity=-1), "max_capacity must be a positive int, got -1"),
    (dict(init_capacity=0), r"init_capacity 0 must be in \(0, max_capacity=None\]"),
    (dict(max_capacity=64, init_capacity=128), r"init_capacity 128 must be in \(0, max_capacity=64\]"),
    (dict(bucket_capacity=24), "bucket_capacity must be a positive multiple of 16, got 24"),
    (dict(max_load_factor=0.0), r"max_load_factor must be in \(0, 1\], got 0.0"),
    (dict(max_load_factor=1.5), r"max_load_factor must be in \(0, 1\], got 1.5"),
    (dict(max_load_factor=True), r"max_load_factor must be in \(0, 1\], got True"),  # (a bool read as 1)
    (dict(index_type=torch.float32), "index_type must be torch.int64 or torch.int32, got torch.float32"),
    (dict(embedding_dtype=torch.int8), "embedding_dtype must be float32, float16 or bfloat16, got torch.int8"),
    (dict(score_strategy=9), "unknown score_strategy 9"),
    (dict(initializer_args="normal"), "initializer_args must be a DynamicEmbInitializerArgs, got 'normal'"),
    (dict(safe_check_mode=7), "unknown safe_check_mode 7; use ERROR, WARNING or IGNORE"),
    (dict(global_hbm_for_values=-1), "global_hbm_for_values must be >= 0 bytes, got -1"),
    (dict(caching="yes"), "caching must be a bool, got 'yes'"),
    (dict(num_embeddings=0), "num_embeddings must be a positive int, got 0"),
    (dict(num_shards=0), "num_shards must be a positive int, got 0"),
    (dict(admit_strategy=FrequencyAdmissionStrategy(2)), "admit_strategy and admission_counter must be given together"),
    (dict(admit_strategy=2, admission_counter=KVCounter(64)), "admit_strategy must be a FrequencyAdmissionStrategy"),
]


@pytest.mark.parametrize("kwargs,match", BAD_OPTIONS, ids=lambda x: str(x)[:40])
def test_bad_field_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match="DynamicEmbTableOptions: " + match):
        DynamicEmbTableOptions(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode=9), r"DynamicEmbInitializerArgs.mode: unknown initializer 9"),
    (dict(std_dev=-1.0), r"DynamicEmbInitializerArgs.std_dev must be >= 0, got -1.0"),
    (dict(mean=float("nan")), r"DynamicEmbInitializerArgs.mean must be a finite number, got nan"),
    (dict(lower=1.0, upper=0.0), r"initializer lower bound 1.0 exceeds upper bound 0.0"),
])
def test_bad_initializer_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicEmbInitializerArgs(**kwargs)


def test_admission_types_checked():
    with pytest.raises(ValueError, match="admission threshold must be >= 1, got 0"):
        FrequencyAdmissionStrategy(0)
    with pytest.raises(ValueError, match="KVCounter.bucket_capacity must be a positive multiple of 16, got 20"):
        KVCounter(64, bucket_capacity=20)


def test_fields_filled_later_and_the_table_named():
    o = DynamicEmbTableOptions()  # dim, max_capacity, num_embeddings: the planner's to fill
    assert o.dim is None and o.max_capacity is None
    with pytest.raises(ValueError, match="table 'x': dim must be a positive int, got None"):
        o.validate("x")
    o.dim, o.max_capacity = 4, 64
    o.validate("x")
    o.dist_type = "foo"  # set after construction: the module's validate names the table
    with pytest.raises(ValueError, match="table 'x': unknown dist_type 'foo'"):
        o.validate("x")
    with pytest.raises(ValueError, match="table 't0': caching=True needs global_hbm_for_values > 0"):
        make_module([4], caching=True)


def test_a_cached_table_must_evict():
    """A NO_EVICTION cache could never make room: every later key would be
    served from the store, and the full store would drop trained rows."""
    with pytest.raises(ValueError, match="table 't0': caching=True needs a score strategy that evicts"):
        make_module([4], caching=True, global_hbm_for_values=4096,
                    score_strategy=DynamicEmbScoreStrategy.NO_EVICTION)
    make_module([4], caching=True, global_hbm_for_values=4096)  # the default strategy evicts


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_tables_with_optimizer_state_warn_that_it_is_kept_in_their_dtype(dtype):
    """FBGEMM keeps optimizer state in float32; ours sits in the row, in the
    table's dtype (an fp16 Adagrad accumulator saturates at 65504)."""
    def make(optimizer, d=dtype):
        return BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=64, embedding_dtype=d)],
                                             ["t"], optimizer=optimizer)
    with pytest.warns(RuntimeWarning, match=rf"tables \['t'\]: EXACT_ADAGRAD's state is kept in the tables' {dtype}"):
        make(EmbOptimType.EXACT_ADAGRAD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(EmbOptimType.EXACT_SGD)  # no state
        make(EmbOptimType.ADAM, torch.float32)


@pytest.mark.parametrize("kw, match", [
    (dict(learning_rate=float("nan")), "lr must be a finite number, got nan"),
    (dict(learning_rate=float("inf")), "lr must be a finite number"),
    (dict(learning_rate=-1.0), r"lr must be a number >= 0, got -1.0"),
    (dict(beta1=2.0), r"beta1 must be in \[0, 1\), got 2.0"),
    (dict(beta2=-0.5), r"beta2 must be in \[0, 1\)"),
    (dict(eps=float("nan")), "eps must be a finite number"),
])
def test_hyper_parameters_out_of_range_are_refused_naming_the_tables(kw, match):
    """A NaN or inf learning rate (or eps) turned every updated row into NaN
    with nothing counted; torch.optim's ranges are refused as torch refuses them."""
    with pytest.raises(ValueError, match=rf"tables \['t'\]: {match}"):
        BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=64)], ["t"],
                                      optimizer=EmbOptimType.ADAM, **kw)
    m = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=64)], ["t"])
    with pytest.raises(ValueError, match=r"tables \['t'\]: lr must be a finite number"):
        m.set_learning_rate(float("nan"))
    assert m.get_learning_rate() == 0.01


def test_bounds_that_cross_a_default_bound_name_the_table_and_the_default():
    from dynamicemb import DynamicEmbInitializerMode
    args = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.UNIFORM, lower=1.0)
    with pytest.raises(ValueError, match=r"table 't': initializer lower bound 1.0 exceeds upper bound 0.1 \(upper: "
                                         r"the default sqrt\(1 / num_embeddings 100\)\); give both"):
        BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=64, num_embeddings=100,
                                                              initializer_args=args)], ["t"])


def test_sizing_helpers_given_a_table_config_say_to_pass_numbers():
    """NVIDIA's helpers take the table config first; given one, ours blamed
    the optimizer (its bucket capacity in our optimizer's place)."""
    from types import SimpleNamespace
    from dynamicemb import get_sharded_table_capacity, get_table_value_bytes
    config = SimpleNamespace(name="t", num_embeddings=1000, embedding_dim=8)
    for fn, args in ((get_table_value_bytes, (config, EmbOptimType.ADAM, 2, 128)),
                     (get_sharded_table_capacity, (config, 2, 128))):
        with pytest.raises(TypeError, match=rf"{fn.__name__} takes numbers .*not a table config"):
            fn(*args)
