"""dynamicemb.rules' embedding rules against what the kernels do and against
FBGEMM: each optimizer's state width is the columns an update writes, its
hyper-parameters are those that change its update, a row-wise rule couples
a row's elements, its names and values are FBGEMM's; each column of the
packed initializer is the one the init kernel reads for what it names."""
import pytest
import torch

from dynamicemb import DynamicEmbInitializerArgs, DynamicEmbInitializerMode, get_table_value_bytes, rules
from dynamicemb._ops import ops
from dynamicemb.optimizer import optimizer_code
from emb_helpers import debug_rows, make_module

D, ROWS = 6, 4
BASE = dict(learning_rate=0.1, eps=0.01, beta1=0.9, beta2=0.99, weight_decay=0.05, weight_decay_mode=1)  # L2
OTHER = dict(learning_rate=0.3, eps=0.05, beta1=0.5, beta2=0.5, weight_decay=0.2, weight_decay_mode=2)  # DECOUPLE
ALL = [pytest.param(o, id=o.name) for o in rules.OPTIMIZERS]


def _update(rule, grad, hyper=BASE, extra=3 * D + 2, seed=0):
    """Rows [ROWS, D + extra] (random weights, zero state) after one update
    by `rule`, bag b holding row b once (SUM pooling)."""
    w = torch.zeros(ROWS, D + extra)
    w[:, :D] = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(seed))
    one = torch.arange(ROWS)
    ops.emb_backward_update(grad, [w], one, torch.zeros(ROWS, dtype=torch.int64), one, torch.arange(ROWS + 1),
                            [0], [D], None, 0, rule.code, hyper["learning_rate"], hyper["eps"], hyper["beta1"],
                            hyper["beta2"], hyper["weight_decay"], 1, hyper["weight_decay_mode"])
    return w


def _grad(seed=1):
    g = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(seed))
    return torch.where(g == 0, 1.0, g)  # every element gets a gradient


@pytest.mark.parametrize("rule", ALL)
def test_state_width_is_the_columns_an_update_writes(rule):
    w = _update(rule, _grad())
    written = torch.nonzero((w[:, D:] != 0).any(0)).flatten().tolist()
    assert written == list(range(rule.state_width(D)))
    # The kernel refuses rows one column narrower than that.
    if rule.state_width(D):
        with pytest.raises(RuntimeError, match="no room for the optimizer state"):
            _update(rule, _grad(), extra=rule.state_width(D) - 1)


@pytest.mark.parametrize("rule", ALL)
def test_module_and_planner_size_rows_by_the_rule(rule):
    m = make_module([D, 2 * D], optimizer=rule.name)
    assert [m.storage.rows_of(t).shape[1] for t in range(m.num_tables)] == [d + rule.state_width(d) for d in (D, 2 * D)]
    assert get_table_value_bytes(10, D, torch.float32, rule.name) == 10 * (D + rule.state_width(D)) * 4


@pytest.mark.parametrize("rule", ALL)
@pytest.mark.parametrize("name", rules.HYPER_PARAMETERS)
def test_hyper_parameters_are_those_that_change_the_update(rule, name):
    base = _update(rule, _grad())
    changed = _update(rule, _grad(), hyper={**BASE, name: OTHER[name]})
    assert (not torch.equal(base, changed)) == (name in rule.hyper_parameters)


@pytest.mark.parametrize("rule", ALL)
def test_rowwise_rules_couple_a_rows_elements(rule):
    g = _grad()
    alone = g.clone()
    alone[:, 1:] = 0  # element 0's gradient as before, the others' gone
    coupled = not torch.equal(_update(rule, g)[:, 0], _update(rule, alone)[:, 0])
    assert coupled == rule.rowwise


@pytest.mark.parametrize("rule", ALL)
def test_names_and_values_are_fbgemms(rule):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    assert EmbOptimType[rule.name].value == rule.values[0]
    for given in (EmbOptimType[rule.name], rule.name, rule.name.lower(), *rule.values):
        assert optimizer_code(given) == rule.code
    assert len({o.code for o in rules.OPTIMIZERS}) == len(rules.OPTIMIZERS)


def test_weight_decay_modes_are_fbgemms():
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
    assert {m.name: int(m) for m in rules.WeightDecayMode} == \
        {m.name: int(m) for m in WeightDecayMode if m.name in rules.WeightDecayMode.__members__}


# ---- the packed initializer ---------------------------------------------------------------


def _init_rows(keys=range(2000), dim=16, seed=0, **columns):
    """Rows that emb_init_rows writes from a packed row given by column name."""
    row = [0.0] * len(rules.INIT_ARGS)
    for name, value in columns.items():
        row[rules.INIT_ARGS.index(name)] = float(value)
    keys = torch.tensor(list(keys), dtype=torch.int64)
    w = torch.zeros(keys.numel(), dim)
    ops.emb_init_rows([w], torch.arange(keys.numel()), torch.zeros_like(keys), keys, [dim],
                      torch.tensor([row], dtype=torch.float64), seed)
    return w


def _mode(name):
    return rules.INIT_MODES.index(name)


def test_init_modes_are_the_public_enum():
    assert [m.name for m in sorted(DynamicEmbInitializerMode)] == list(rules.INIT_MODES)
    assert [int(m) for m in sorted(DynamicEmbInitializerMode)] == list(range(len(rules.INIT_MODES)))


def test_init_columns_are_the_ones_the_kernel_reads():
    assert torch.all(_init_rows(mode=_mode("CONSTANT"), value=2.5) == 2.5)
    w = _init_rows(mode=_mode("UNIFORM"), lower=-0.25, upper=0.75)
    assert w.min() >= -0.25 and w.max() <= 0.75 and abs(w.mean() - 0.25) < 0.02
    w = _init_rows(mode=_mode("NORMAL"), mean=3.0, std_dev=0.5)
    assert abs(w.mean() - 3.0) < 0.02 and abs(w.std() - 0.5) < 0.02
    w = _init_rows(mode=_mode("TRUNCATED_NORMAL"), mean=0.0, std_dev=1.0, lower=-0.5, upper=0.5)
    assert w.min() >= -0.5 and w.max() <= 0.5 and w.std() > 0.2
    torch.testing.assert_close(_init_rows(keys=[7, 123456], dim=4, mode=_mode("DEBUG")), debug_rows([7, 123456], 4),
                               atol=0, rtol=0)
    # The stream column picks the random stream: another one, other rows.
    args = dict(mode=_mode("UNIFORM"), lower=-1, upper=1)
    assert torch.equal(_init_rows(stream=3, **args), _init_rows(stream=3, **args))
    assert not torch.equal(_init_rows(stream=3, **args), _init_rows(stream=4, **args))


def test_packed_initializer_is_laid_out_by_column_name():
    a = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL, mean=1.5, std_dev=0.25)
    packed = dict(zip(rules.INIT_ARGS, a.packed(None, 9)))
    assert packed["mode"] == int(DynamicEmbInitializerMode.NORMAL) and packed["stream"] == 9
    assert (packed["mean"], packed["std_dev"]) == (1.5, 0.25)
    assert torch.equal(_init_rows(**packed), _init_rows(mode=_mode("NORMAL"), mean=1.5, std_dev=0.25, stream=9))


def test_int8_row_tail_is_fbgemms():
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    x = torch.randn(3, 12)
    assert torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(x).shape[1] - 12 == rules.INT8_ROW_TAIL
