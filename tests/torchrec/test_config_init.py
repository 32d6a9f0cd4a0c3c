"""A TorchRec config's initial rows reach its dynamic table: weight_init_min /
weight_init_max, or an init_fn naming one of torch's initializers, become the
table's initializer when its initializer_args are left default (before, the
table silently used +-sqrt(1 / num_embeddings)); an init_fn it cannot follow,
and options contradicting the config, are refused by table name."""
import functools

import pytest
import torch
import torchrec
from torchrec.distributed.planner import Topology

import models
from dynamicemb import DynamicEmbInitializerArgs, DynamicEmbInitializerMode, DynamicEmbTableOptions
from dynamicemb.config_init import table_initializer
from dynamicemb.planner import DynamicEmbeddingShardingPlanner, DynamicEmbParameterConstraints
from multiprocess import run_ranks

Mode = DynamicEmbInitializerMode
N = 400  # num_embeddings: TorchRec's default bounds +-0.05


def _config(name="d_table", **kw):
    return torchrec.EmbeddingBagConfig(name=name, embedding_dim=8, num_embeddings=N, feature_names=["f"], **kw)


@pytest.mark.parametrize("init, want", [
    (dict(weight_init_min=-0.5, weight_init_max=0.25), DynamicEmbInitializerArgs(lower=-0.5, upper=0.25)),
    (dict(init_fn=functools.partial(torch.nn.init.uniform_, a=0.0, b=2.0)), DynamicEmbInitializerArgs(lower=0.0,
                                                                                                    upper=2.0)),
    (dict(init_fn=functools.partial(torch.nn.init.normal_, std=0.01)),
     DynamicEmbInitializerArgs(mode=Mode.NORMAL, mean=0.0, std_dev=0.01)),
    (dict(init_fn=functools.partial(torch.nn.init.trunc_normal_, mean=1.0, std=0.5, a=0.5, b=1.5)),
     DynamicEmbInitializerArgs(mode=Mode.TRUNCATED_NORMAL, mean=1.0, std_dev=0.5, lower=0.5, upper=1.5)),
    (dict(init_fn=functools.partial(torch.nn.init.constant_, val=0.125)),
     DynamicEmbInitializerArgs(mode=Mode.CONSTANT, value=0.125)),
    (dict(init_fn=torch.nn.init.zeros_), DynamicEmbInitializerArgs(mode=Mode.CONSTANT, value=0.0)),
    (dict(init_fn=torch.nn.init.ones_), DynamicEmbInitializerArgs(mode=Mode.CONSTANT, value=1.0)),
])
def test_the_configs_initializer_replaces_the_default(init, want):
    assert table_initializer(_config(**init), DynamicEmbInitializerArgs()) == want


def test_torchrecs_default_keeps_the_options():
    for args in (DynamicEmbInitializerArgs(), DynamicEmbInitializerArgs(mode=Mode.NORMAL, std_dev=0.3)):
        assert table_initializer(_config(), args) is args
    # The same bounds given explicitly are TorchRec's default too.
    explicit = _config(weight_init_min=-(1 / N) ** 0.5, weight_init_max=(1 / N) ** 0.5)
    assert table_initializer(explicit, DynamicEmbInitializerArgs(mode=Mode.DEBUG)).mode == Mode.DEBUG


def test_an_init_fn_cleared_after_construction_reads_as_torchrecs():
    config = _config(weight_init_min=-0.5, weight_init_max=0.25)
    config.init_fn = None
    assert table_initializer(config, DynamicEmbInitializerArgs()) == DynamicEmbInitializerArgs(lower=-0.5, upper=0.25)
    config = _config()
    config.init_fn = None
    assert table_initializer(config, DynamicEmbInitializerArgs()) == DynamicEmbInitializerArgs()


def test_options_agreeing_with_the_config_are_kept():
    args = DynamicEmbInitializerArgs(lower=-0.5, upper=0.25)
    assert table_initializer(_config(weight_init_min=-0.5, weight_init_max=0.25), args) is args


def test_an_init_fn_it_cannot_follow_is_refused_by_table():
    for fn in (lambda w: w.normal_(), torch.nn.init.xavier_uniform_,
               functools.partial(torch.nn.init.normal_, nonsense=1)):
        with pytest.raises(ValueError, match=r"table 'd_table': its config's init_fn .* cannot initialise a "
                                             r"dynamic table.*initializer_args"):
            table_initializer(_config(init_fn=fn), DynamicEmbInitializerArgs())


def test_bounds_crossed_in_the_config_are_refused_by_table():
    with pytest.raises(ValueError, match=r"table 'd_table': its config's init_fn: .*lower bound 0.5 exceeds upper "
                                         r"bound -0.5"):
        table_initializer(_config(weight_init_min=0.5, weight_init_max=-0.5), DynamicEmbInitializerArgs())


def test_options_contradicting_the_config_are_refused_by_table():
    with pytest.raises(ValueError, match=r"table 'd_table': dynamicemb_options.initializer_args \(NORMAL\(mean=0.0, "
                                         r"std_dev=0.3\)\) contradict .* \(UNIFORM in \[-0.5, 0.25\]\)"):
        table_initializer(_config(weight_init_min=-0.5, weight_init_max=0.25),
                          DynamicEmbInitializerArgs(mode=Mode.NORMAL, std_dev=0.3))


def test_the_planner_completes_the_options_with_the_configs_initializer():
    configs = [_config("a_table", weight_init_min=0.25, weight_init_max=0.5), _config("b_table")]
    constraints = {c.name: DynamicEmbParameterConstraints(use_dynamicemb=True,
                                                          dynamicemb_options=DynamicEmbTableOptions())
                   for c in configs}
    planner = DynamicEmbeddingShardingPlanner(configs, topology=Topology(world_size=2, compute_device="cpu"),
                                              constraints=constraints)
    assert planner.options["a_table"].initializer_args == DynamicEmbInitializerArgs(lower=0.25, upper=0.5)
    assert planner.options["b_table"].initializer_args == DynamicEmbInitializerArgs()
    # The user's options object is left as it was.
    assert constraints["a_table"].dynamicemb_options.initializer_args == DynamicEmbInitializerArgs()


TABLES = ["a_table", "b_table", "c_table"]


def _new_rows(rank, world):
    """Per table, (count, min, max, mean, std) of the rows a training forward
    gives new keys under DMP (plain numbers: a tensor sent back from a rank
    travels as a file descriptor that the rank's exit may close first)."""
    pg = models.rank_groups()[0]
    configs = [torchrec.EmbeddingBagConfig(name="a_table", embedding_dim=16, num_embeddings=N,
                                           feature_names=["a_feature"], weight_init_min=0.25, weight_init_max=0.5),
               torchrec.EmbeddingBagConfig(name="b_table", embedding_dim=16, num_embeddings=N,
                                           feature_names=["b_feature"],
                                           init_fn=functools.partial(torch.nn.init.normal_, mean=3.0, std=0.01)),
               torchrec.EmbeddingBagConfig(name="c_table", embedding_dim=16, num_embeddings=N,
                                           feature_names=["c_feature"])]
    constraints = {n: DynamicEmbParameterConstraints(use_dynamicemb=True) for n in TABLES}
    model = models.build("ebc", configs, pg, constraints, models.SGD)
    batch = models.random_batch([n.replace("table", "feature") for n in TABLES], 8, N, seed=0)
    model(models.kjt(batch))  # stores the keys with their initial rows; no backward: rows as initialised
    keys = torch.arange(N)
    out = {}
    for n in TABLES:
        rows, owner = models.stored_rows(model, n, keys, pg)
        r = rows[owner >= 0, :16]
        out[n] = (r.numel(), float(r.min()), float(r.max()), float(r.mean()), float(r.std()))
    return out


def test_new_keys_get_the_configs_initial_rows_under_dmp():
    rows = run_ranks(_new_rows, 1)[0]
    assert min(rows[n][0] for n in TABLES) > 100
    _, lo, hi, _, std = rows["a_table"]
    assert 0.25 <= lo and hi <= 0.5 and std > 0.05  # uniform in [0.25, 0.5]
    _, _, _, mean, std = rows["b_table"]
    assert abs(mean - 3.0) < 0.005 and 0.005 < std < 0.02  # normal(3, 0.01)
    _, lo, hi, _, std = rows["c_table"]
    bound = (1 / N) ** 0.5  # TorchRec's default, as before
    assert -bound <= lo and hi <= bound and std > bound / 4
