"""Issue 36's optimizer knobs on the module, each against an independent
reference: PARTIAL_ROWWISE_ADAM and FBGEMM's gradient_clipping against a
float64 Python model of FBGEMM's rules (tests/optim_reference.py; FBGEMM's
CPU TBE has neither) and, where its CPU TBE has the optimizer, against
FBGEMM fed the clamped gradients; initial_accumulator_value against FBGEMM's
CPU TBE with its accumulators filled with the value, for new rows, re-used
(evicted) slots, cached tables and rows loaded without state."""
import os
import sys

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice, EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

from dynamicemb import DynamicEmbPoolingMode, EmbOptimType, rules
from emb_helpers import DEBUG_INIT, bags, debug_rows, make_module, random_batch, stored

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: optim_reference
from optim_reference import ReferenceOptimizer  # noqa: E402

HYPER = dict(learning_rate=0.05, eps=1e-3, beta1=0.8, beta2=0.95)
FTM = [0, 1, 0]  # table 0 serves two features: a key's gradient sums over both
B = 5


def _key_grads(indices, offsets, probe, dims, mean):
    """{(table, key): gradient summed over the batch} for loss = sum(out * probe)."""
    grads, col = {}, [0]
    for t in FTM:
        col.append(col[-1] + dims[t])
    for j in range(len(FTM) * B):
        f, b = divmod(j, B)
        lo, hi = int(offsets[j]), int(offsets[j + 1])
        for i in range(lo, hi):
            g = probe[b, col[f]:col[f + 1]].double() / ((hi - lo) if mean else 1)
            k = (FTM[f], int(indices[i]))
            grads[k] = grads.get(k, 0) + g
    return grads


def _train_against_reference(optimizer, dims, device, pooling="SUM", steps=4, weight_decay=0.0, between=None,
                             **knobs):
    """The module and the Python model over the same random batches (keys
    repeat within and across bags); full rows (weights and state) compared
    after every step. between(step, module, refs) runs before each step."""
    mk = dict(HYPER, weight_decay=weight_decay, **knobs)
    m = make_module(dims, pooling=DynamicEmbPoolingMode[pooling], optimizer=optimizer, feature_table_map=FTM,
                    initializer_args=DEBUG_INIT, device=device, module_kwargs=mk)
    clip = knobs.get("max_gradient") if knobs.get("gradient_clipping") else None
    refs = [ReferenceOptimizer(optimizer.name, d, lr=mk["learning_rate"], eps=mk["eps"], beta1=mk["beta1"],
                               beta2=mk["beta2"], weight_decay=weight_decay,
                               initial_accumulator_value=knobs.get("initial_accumulator_value", 0.0)) for d in dims]
    gen = torch.Generator().manual_seed(11)
    clipped = 0
    for step in range(steps):
        if between is not None:
            between(step, m, refs)
        indices, offsets = random_batch(gen, FTM, [12, 9], B, max_len=4)
        probe = torch.randn(B, sum(dims[t] for t in FTM), generator=gen)
        out = m(indices.to(device), offsets.to(device))
        (out * probe.to(device)).sum().backward()
        # FBGEMM's clipping: each bag's output gradient, before the sums per key.
        grads = _key_grads(indices, offsets, probe if clip is None else probe.clamp(-clip, clip), dims,
                           pooling == "MEAN")
        for (t, k) in grads:
            if k not in refs[t].rows:
                refs[t].add(k, debug_rows([k], dims[t])[0])
        for t, ref in enumerate(refs):
            ref.step({k: g for (tt, k), g in grads.items() if tt == t})
        if clip is not None:
            clipped += int((probe.abs() > clip).sum())
        for t, ref in enumerate(refs):
            keys = sorted(ref.rows)
            found, rows = stored(m, t, keys)
            assert bool(found.all())
            want = torch.stack([ref.rows[k] for k in keys]).float()
            assert rows.shape == want.shape  # the state width is the rule's
            torch.testing.assert_close(rows, want, rtol=2e-5, atol=2e-6)
    assert clip is None or clipped > 0, "no gradient reached the bound"
    return m


@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
@pytest.mark.parametrize("dims", [[5, 3], [300, 40]])  # one chunk of a CUDA warp, and several
def test_partial_rowwise_adam_matches_fbgemms_rule(pooling, dims, device):
    m = _train_against_reference(EmbOptimType.PARTIAL_ROWWISE_ADAM, dims, device, pooling, weight_decay=0.01)
    assert [m.storage.rows_of(t).shape[1] for t in range(m.num_tables)] == [2 * d + 1 for d in dims]


@pytest.mark.parametrize("dims", [[5, 3], [300, 40]])
def test_lamb_matches_fbgemms_rule(dims, device):
    m = _train_against_reference(EmbOptimType.LAMB, dims, device, weight_decay=0.01)
    assert [m.storage.rows_of(t).shape[1] for t in range(m.num_tables)] == [3 * d for d in dims]


def test_partial_rowwise_adam_state_is_about_half_of_adams():
    pra, adam = rules.optimizer(optimizer_id("PARTIAL_ROWWISE_ADAM")), rules.optimizer(optimizer_id("ADAM"))
    assert (pra.state_width(128), adam.state_width(128)) == (129, 256)


def optimizer_id(name):
    return next(o.code for o in rules.OPTIMIZERS if o.name == name)


@pytest.mark.parametrize("optimizer", [o.name for o in rules.OPTIMIZERS])
def test_gradient_clipping_matches_the_reference(optimizer, device):
    wd = 0.01 if "weight_decay_mode" not in rules.optimizer(optimizer_id(optimizer)).hyper_parameters and \
        "weight_decay" in rules.optimizer(optimizer_id(optimizer)).hyper_parameters else 0.0
    _train_against_reference(EmbOptimType[optimizer], [6, 4], device, weight_decay=wd, gradient_clipping=True,
                             max_gradient=0.3)


def test_max_gradient_is_read_only_with_clipping():
    a = _train_against_reference(EmbOptimType.EXACT_SGD, [4, 4], "cpu", max_gradient=1e-4)  # reference: no clip
    assert not a.gradient_clipping


# ---- against FBGEMM's CPU TBE -------------------------------------------------------------------

FBGEMM_CPU = [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD]
NUM_KEYS, DIMS = [40, 30], [4, 8]
# FBGEMM's CPU backward needs a shared table's features adjacent (as TorchRec lays them out).
TBE_FTM = [0, 0, 1]


def _tbe(optimizer, accumulator=0.0, **kw):
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(n, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for n, d in zip(NUM_KEYS, DIMS)],
        feature_table_map=TBE_FTM, optimizer=optimizer, learning_rate=HYPER["learning_rate"], eps=HYPER["eps"],
        pooling_mode=PoolingMode.SUM, **kw)
    with torch.no_grad():
        for t, w in enumerate(tbe.split_embedding_weights()):
            w.copy_(debug_rows(range(NUM_KEYS[t]), DIMS[t]))  # our DEBUG initial rows
    if optimizer != EmbOptimType.EXACT_SGD:
        with torch.no_grad():
            for states in tbe.split_optimizer_states():
                states[0].fill_(accumulator)
    return tbe


def _check_against_tbe(tbe, m, optimizer):
    states = tbe.split_optimizer_states() if optimizer != EmbOptimType.EXACT_SGD else None
    for t, w in enumerate(tbe.split_embedding_weights()):
        found, rows = stored(m, t, torch.arange(NUM_KEYS[t]))
        rows = rows[found]
        torch.testing.assert_close(rows[:, :DIMS[t]], w[found], atol=1e-5, rtol=0)
        if states is not None:
            torch.testing.assert_close(rows[:, DIMS[t]:], states[t][0].reshape(NUM_KEYS[t], -1)[found],
                                       atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("optimizer", FBGEMM_CPU)
def test_gradient_clipping_equals_fbgemms(optimizer):
    """FBGEMM's own gradient_clipping, keys repeated within and across bags:
    it clamps each bag's output gradient before the sums per key (a key's
    summed gradient may exceed max_gradient)."""
    tbe = _tbe(optimizer, gradient_clipping=True, max_gradient=0.2)
    m = make_module(DIMS, optimizer=optimizer, feature_table_map=TBE_FTM, initializer_args=DEBUG_INIT,
                    module_kwargs=dict(HYPER, gradient_clipping=True, max_gradient=0.2))
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        indices, offsets = random_batch(gen, TBE_FTM, NUM_KEYS, B, max_len=4)
        probe = torch.randn(B, sum(DIMS[t] for t in TBE_FTM), generator=gen)
        (m(indices, offsets) * probe).sum().backward()
        (tbe(indices, offsets) * probe).sum().backward()
        _check_against_tbe(tbe, m, optimizer)


@pytest.mark.parametrize("optimizer", FBGEMM_CPU[1:])
@pytest.mark.parametrize("start", ["initialized", "inserted"])
def test_initial_accumulator_value_equals_fbgemm_with_filled_accumulators(optimizer, start):
    """New rows (the init kernels) and rows stored without state
    (insert_rows) start their accumulators at the value."""
    v = 0.5
    tbe = _tbe(optimizer, accumulator=v)
    m = make_module(DIMS, optimizer=optimizer, feature_table_map=TBE_FTM, initializer_args=DEBUG_INIT,
                    module_kwargs=dict(HYPER, initial_accumulator_value=v))
    if start == "inserted":
        for t, w in enumerate(tbe.split_embedding_weights()):
            m.storage.insert_rows(t, torch.arange(NUM_KEYS[t]), w.clone())
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        indices, offsets = random_batch(gen, TBE_FTM, NUM_KEYS, B, max_len=4)
        probe = torch.randn(B, sum(DIMS[t] for t in TBE_FTM), generator=gen)
        (m(indices, offsets) * probe).sum().backward()
        (tbe(indices, offsets) * probe).sum().backward()
        _check_against_tbe(tbe, m, optimizer)


# ---- where else a row's state starts -------------------------------------------------------------


def _state(m, t, keys):
    found, rows = stored(m, t, keys)
    assert bool(found.all())
    return rows[:, m.dims[t]:]


@pytest.mark.parametrize("caching", [False, True])
def test_reused_slots_restart_from_the_initial_accumulator(caching, device):
    """A full bucket evicts trained rows: the new keys in their slots, and an
    evicted key that comes back, start from the value. With a cache, the
    cache's new rows start from it, and evicted rows come back from the
    backing store with their trained state."""
    v = 0.25
    extra = dict(caching=True, global_hbm_for_values=16 * 5 * 4) if caching else {}  # a cache of 16 rows
    m = make_module([4], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, max_capacity=64 if caching else 16,
                    bucket_capacity=16, device=device, module_kwargs=dict(HYPER, initial_accumulator_value=v),
                    **extra)
    old = list(range(16))
    (m(*bags([old], device)) * 3).sum().backward()
    trained = _state(m, 0, old)
    assert bool((trained > v).all())
    new = list(range(100, 116))
    with torch.no_grad():
        m(*bags([new], device))  # stored with their initial rows (evicting the old ones), no update
    assert torch.equal(_state(m, 0, new), torch.full((16, 1), v))
    with torch.no_grad():
        m(*bags([old[:3]], device))
    back = _state(m, 0, old[:3])
    assert torch.equal(back, trained[:3] if caching else torch.full((3, 1), v))


def test_rows_loaded_without_state_start_from_the_initial_accumulator(tmp_path):
    from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad
    kw = dict(optimizer=EmbOptimType.EXACT_ADAGRAD, initializer_args=DEBUG_INIT)
    m = make_module([4], module_kwargs=dict(HYPER, initial_accumulator_value=0.1), **kw)
    (m(*bags([[1, 2, 3]])) * 2).sum().backward()
    DynamicEmbDump(str(tmp_path / "ck"), m, optim=False)
    fresh = make_module([4], module_kwargs=dict(HYPER, initial_accumulator_value=0.7), **kw)
    DynamicEmbLoad(str(tmp_path / "ck"), fresh, optim=False)
    assert torch.equal(_state(fresh, 0, [1, 2, 3]), torch.full((3, 4), 0.7))
    assert torch.equal(stored(fresh, 0, [1, 2, 3])[1][:, :4], stored(m, 0, [1, 2, 3])[1][:, :4])


def test_partial_rowwise_adam_checkpoint_round_trip(tmp_path):
    from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad
    kw = dict(optimizer=EmbOptimType.PARTIAL_ROWWISE_ADAM, initializer_args=DEBUG_INIT, module_kwargs=HYPER)
    m = make_module([6, 3], feature_table_map=FTM, **kw)
    gen = torch.Generator().manual_seed(2)
    batches = [random_batch(gen, FTM, [20, 20], B, max_len=3) for _ in range(4)]
    for idx, off in batches[:3]:
        m(idx, off).sum().backward()
    DynamicEmbDump(str(tmp_path / "ck"), m)
    fresh = make_module([6, 3], feature_table_map=FTM, **kw)
    DynamicEmbLoad(str(tmp_path / "ck"), fresh)
    for t in range(2):
        keys = sorted(k for ks, _, _ in m.storage.export(t) for k in ks.tolist())
        assert torch.equal(stored(fresh, t, keys)[1], stored(m, t, keys)[1])
        assert stored(m, t, keys)[1].shape[1] == 2 * m.dims[t] + 1 and bool(_state(m, t, keys).any())
    for mod in (m, fresh):  # the next step (bias corrections by the restored step) agrees
        mod(*batches[3]).sum().backward()
    for t in range(2):
        keys = sorted(k for ks, _, _ in m.storage.export(t) for k in ks.tolist())
        assert torch.equal(stored(fresh, t, keys)[1], stored(m, t, keys)[1])


# ---- refusals ----------------------------------------------------------------------------------------


def _new_hyper_parameters(step, m, refs):
    if step == 2:
        m.update_hyper_parameters({"lr": 0.02, "eps": 1e-4, "beta1": 0.5, "beta2": 0.75, "weight_decay": 0.01})
        m.set_optimizer_step(9)
        for r in refs:
            r.lr, r.eps, r.b1, r.b2, r.wd, r.t = 0.02, 1e-4, 0.5, 0.75, 0.01, 9


def test_hyper_parameters_changed_between_steps_match_the_reference(device):
    """FBGEMM's update_hyper_parameters and set_optimizer_step (which TorchRec's
    fused optimizer calls) between steps: ADAM's next updates read the new
    values, its bias correction going on from step 10."""
    m = _train_against_reference(EmbOptimType.ADAM, [5, 3], device, steps=5, between=_new_hyper_parameters)
    assert (m.optimizer_step, m.get_learning_rate()) == (12, 0.02)


@pytest.mark.parametrize("params,match", [
    ({"eps": 1e-3, "lower_bound": 0.1}, r"hyper-parameters \['lower_bound'\] cannot be updated"),
    ({"eps": 1e-3, "lr": float("nan")}, "lr must be a finite number"),
    ({"eps": 1e-3, "weight_decay": 0.1}, "EXACT_SGD has no weight decay"),
])
def test_hyper_parameter_updates_are_checked_whole(params, match):
    m = make_module([4], module_kwargs=dict(table_names=["ads"], eps=1e-8))
    with pytest.raises(ValueError, match="tables \\['ads'\\]: " + match):
        m.update_hyper_parameters(params)
    assert (m.eps, m.learning_rate, m.weight_decay) == (1e-8, 0.01, 0.0)  # nothing changed
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="set_optimizer_step takes an int >= 0"):
            m.set_optimizer_step(bad)


@pytest.mark.parametrize("kwargs,match", [
    (dict(optimizer=EmbOptimType.ADAM, initial_accumulator_value=0.1),
     "initial_accumulator_value applies to EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD only, not to ADAM"),
    (dict(optimizer=EmbOptimType.EXACT_ADAGRAD, initial_accumulator_value=-1.0), "must be >= 0"),
    (dict(optimizer=EmbOptimType.EXACT_ADAGRAD, initial_accumulator_value=float("nan")), "finite number"),
    (dict(gradient_clipping=True, max_gradient=0.0), "max_gradient must be > 0"),
    (dict(gradient_clipping=True, max_gradient=float("inf")), "max_gradient must be a finite number"),
])
def test_knobs_that_would_be_ignored_or_are_invalid_are_refused(kwargs, match):
    kwargs = dict(kwargs)  # the parameter's dict is shared by this test's runs (conftest.py: row_parts)
    optimizer = kwargs.pop("optimizer", EmbOptimType.EXACT_SGD)
    with pytest.raises(ValueError, match=r"dynamicemb: tables \['\w+'\]: .*" + match):  # (naming the tables)
        make_module([4], optimizer=optimizer, module_kwargs=kwargs)
