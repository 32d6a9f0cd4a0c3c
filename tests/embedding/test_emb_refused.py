"""Refused at the door (issue 35 §2): ids that are not integers and
non-finite per-sample weights are named errors that store nothing; a
non-finite gradient is counted per table (nonfinite_grads) and, per
safe_check_mode, fails the step before any row is written (ERROR) or
leaves out just the rows it reaches (WARNING, IGNORE)."""
import warnings

import pytest
import torch

from dynamicemb import DynamicEmbCheckMode, DynamicEmbPoolingMode, EmbOptimType
from emb_helpers import DEBUG_INIT, bags, debug_rows, make_module, random_batch, stored

SUM, MEAN, NONE = DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.MEAN, DynamicEmbPoolingMode.NONE
FTM = [0, 1, 0]  # table 0 serves two features
B = 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_non_integer_ids_refused(dtype):
    m = make_module([4, 4], feature_table_map=[0, 1])
    before = m.table_stats()
    with pytest.raises(TypeError, match=rf"indices must be an int64 or int32 tensor, got {dtype} "
                                        rf"\(features \['t0', 't1'\], tables \['t0', 't1'\]\)"):
        m(torch.tensor([1, 2, 3]).to(dtype), torch.tensor([0, 1, 2, 3, 3]))
    assert m.table_stats() == before and m.step == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_refused(bad):
    m = make_module([4, 4], feature_table_map=[0, 1])
    indices, offsets = bags([[1, 2], [3], [4], [5, 6]])  # B = 2: features t0 (bags 0, 1), t1 (bags 0, 1)
    w = torch.ones(6)
    w[4] = bad  # index 4: feature t1, bag 1
    with pytest.raises(ValueError, match=rf"per-sample weight 4 \(feature 't1', bag 1\) is {bad}; "
                                         r"weights must be finite"):
        m(indices, offsets, w)
    assert all(s["size"] == 0 for s in m.table_stats().values()) and m.step == 0


def _batch_and_poison(pooling, seed):
    """A batch, an output gradient, and where to poison it: the (table, key)
    pairs a poisoned entry reaches, computed from the batch by hand."""
    gen = torch.Generator().manual_seed(seed)
    indices, offsets = random_batch(gen, FTM, [12, 12], B, max_len=3, min_len=1)
    dims = 4
    poison, bad = [], set()
    if pooling == NONE:  # output row i is index i
        for i in (1, indices.numel() - 1):
            poison.append((i, 2))
            f = int(torch.searchsorted(offsets, torch.tensor(i), right=True) - 1) // B
            bad.add((FTM[f], int(indices[i])))
    else:  # output [B, F * dims]: feature f's slice of bag b reaches the bag's indices
        for f, b in ((0, 1), (2, 3)):
            poison.append((b, f * dims + 1))
            j = f * B + b
            bad |= {(FTM[f], int(k)) for k in indices[offsets[j]:offsets[j + 1]].tolist()}
    return indices, offsets, poison, bad


def _rows(m, indices, offsets):
    """{(table, key): stored row (values and optimizer state)} of the batch's keys."""
    out = {}
    for j in range(len(FTM) * B):
        t = FTM[j // B]
        for k in indices[offsets[j]:offsets[j + 1]].tolist():
            out[(t, k)] = stored(m, t, [k])[1][0]
    return out


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.ADAM, EmbOptimType.EXACT_ROWWISE_ADAGRAD],
                         ids=lambda o: o.name)
@pytest.mark.parametrize("pooling", [SUM, MEAN, NONE], ids=lambda p: p.name)
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_warning_skips_the_rows_a_non_finite_gradient_reaches(pooling, optimizer, bad_value):
    # Reference: the same step with the poisoned entries zeroed; the rows they
    # do not reach see exactly the same gradient, those they reach are left as they were.
    kw = dict(pooling=pooling, optimizer=optimizer, feature_table_map=FTM, initializer_args=DEBUG_INIT,
              safe_check_mode=DynamicEmbCheckMode.WARNING)
    m, ref = make_module([4, 4], **kw), make_module([4, 4], **kw)
    indices, offsets, poison, bad = _batch_and_poison(pooling, seed=3)
    for step in range(2):  # the second step: the module goes on after a skipped update
        out, out_ref = m(indices, offsets), ref(indices, offsets)
        before = _rows(m, indices, offsets)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        ref_grad = grad.clone()
        for p in poison:
            grad[p] = bad_value
        out_ref.backward(ref_grad)
        with pytest.warns(RuntimeWarning, match="non-finite") as caught:
            out.backward(grad)
        assert len([w for w in caught if "non-finite" in str(w.message)]) == 1  # once per step
        got, want = _rows(m, indices, offsets), _rows(ref, indices, offsets)
        for tk in got:
            assert torch.equal(got[tk], before[tk] if tk in bad else want[tk]), tk
        # The rows the reference changed, this one did not.
        for tk in bad:
            assert torch.equal(got[tk], before[tk])
        stats = m.table_stats()
        for t, name in enumerate(m.table_names):
            assert stats[name]["nonfinite_grads"] == (step + 1) * len({k for tt, k in bad if tt == t})
        assert all(s["nonfinite_grads"] == 0 for s in ref.table_stats().values())


@pytest.mark.parametrize("pooling", [SUM, NONE], ids=lambda p: p.name)
def test_error_raises_before_any_row_is_written(pooling):
    m = make_module([4, 4], pooling=pooling, optimizer=EmbOptimType.ADAM, feature_table_map=FTM,
                    initializer_args=DEBUG_INIT, safe_check_mode=DynamicEmbCheckMode.ERROR)
    indices, offsets, poison, bad = _batch_and_poison(pooling, seed=5)
    out = m(indices, offsets)
    before = _rows(m, indices, offsets)
    grad = torch.ones(out.shape)
    for p in poison:
        grad[p] = float("nan")
    with pytest.raises(FloatingPointError, match=r"table 't[01]': \d+ rows got a non-finite \(NaN / inf\) gradient "
                                                 r"at optimizer step 1; no row was updated"):
        out.backward(grad)
    after = _rows(m, indices, offsets)
    assert all(torch.equal(after[tk], before[tk]) for tk in before)
    counts = [len({k for tt, k in bad if tt == t}) for t in range(2)]
    assert [m.table_stats()[n]["nonfinite_grads"] for n in m.table_names] == counts
    # The module goes on: a finite step updates every row.
    out = m(indices, offsets)
    out.backward(torch.ones(out.shape))
    after = _rows(m, indices, offsets)
    assert all(not torch.equal(after[tk], before[tk]) for tk in before)


def test_ignore_counts_silently():
    m = make_module([4], safe_check_mode=DynamicEmbCheckMode.IGNORE, initializer_args=DEBUG_INIT)
    out = m(*bags([[1, 2], [2, 3]]))
    grad = torch.ones(out.shape)
    grad[0, 0] = float("nan")  # bag 0: keys 1 and 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out.backward(grad)
    assert m.table_stats()["t0"]["nonfinite_grads"] == 2


def test_finite_gradients_whose_sum_overflows_are_applied():
    # The cheap detector (the gradient's sum) overflows here; the exact
    # per-row check then finds every row finite and updates it (EXACT_SGD by hand).
    m = make_module([4], initializer_args=DEBUG_INIT, safe_check_mode=DynamicEmbCheckMode.ERROR)
    out = m(*bags([[1], [2]]))
    grad = torch.zeros(out.shape)
    grad[:, 0] = 3e38
    out.backward(grad)
    assert m.table_stats()["t0"]["nonfinite_grads"] == 0
    want = debug_rows([1, 2], 4) - torch.tensor(m.learning_rate, dtype=torch.float32) * grad
    torch.testing.assert_close(stored(m, 0, [1, 2])[1], want, rtol=1e-6, atol=0)


def test_warning_skips_a_row_whose_summed_gradient_overflows():
    # Key 1 is in both bags: its summed gradient 3e38 + 3e38 is inf, though
    # every entry is finite. Left out and counted (WARNING); key 2, in one
    # bag, is updated by hand's EXACT_SGD.
    m = make_module([4], initializer_args=DEBUG_INIT, safe_check_mode=DynamicEmbCheckMode.WARNING)
    out = m(*bags([[1, 2], [1]]))
    grad = torch.zeros(out.shape)
    grad[:, 0] = 3e38
    with pytest.warns(RuntimeWarning, match=r"table 't0': 1 rows got a non-finite \(NaN / inf\) gradient at "
                                            r"optimizer step 1; their updates were skipped"):
        out.backward(grad)
    assert m.table_stats()["t0"]["nonfinite_grads"] == 1
    want = debug_rows([1, 2], 4)
    want[1] -= torch.tensor(m.learning_rate, dtype=torch.float32) * grad[0]
    torch.testing.assert_close(stored(m, 0, [1, 2])[1], want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("weighted", [False, True])
def test_error_raises_for_a_row_whose_summed_gradient_overflows(weighted):
    # As above under ERROR: no entry is NaN / inf, so the check before the
    # update passes (with per-sample weights the output gradient's sum is even
    # finite); the update leaves key 1 out, updates key 2, and the step raises
    # (it wrote -inf into key 1's row, silently, and counted nothing).
    m = make_module([4], initializer_args=DEBUG_INIT, safe_check_mode=DynamicEmbCheckMode.ERROR)
    indices, offsets = bags([[1, 2], [1]])
    psw = torch.tensor([3e38, 1.0, 3e38]) if weighted else None
    out = m(indices, offsets, per_sample_weights=psw)
    grad = torch.zeros(out.shape)
    grad[:, 0] = 1.0 if weighted else 3e38
    with pytest.raises(FloatingPointError, match=r"table 't0': 1 rows got a non-finite \(NaN / inf\) gradient at "
                                                 r"optimizer step 1 \(a sum of finite entries that overflowed\)"):
        out.backward(grad)
    assert m.table_stats()["t0"]["nonfinite_grads"] == 1
    rows = stored(m, 0, [1, 2])[1]
    torch.testing.assert_close(rows[0], debug_rows([1], 4)[0], atol=0, rtol=0)  # left out, not -inf
    g2 = grad[0] * (psw[1] if weighted else 1.0)
    torch.testing.assert_close(rows[1], debug_rows([2], 4)[0] - torch.tensor(m.learning_rate) * g2, rtol=1e-6, atol=0)


def test_nonfinite_counts_that_land_later_warn_naming_their_step(monkeypatch):
    """A CUDA step does not wait for its non-finite counts: they are counted
    and warned when their copy lands (here: at table_stats), naming their
    optimizer step. Modelled on the CPU by holding every copy back."""
    from dynamicemb.batched_dynamicemb_tables import BatchedDynamicEmbeddingTables
    from dynamicemb.host_copy import HostCopy
    monkeypatch.setattr(BatchedDynamicEmbeddingTables, "_defers_counts", lambda self, counts: True)
    monkeypatch.setattr(HostCopy, "landed", lambda self: False)
    m = make_module([4], initializer_args=DEBUG_INIT, safe_check_mode=DynamicEmbCheckMode.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = m(*bags([[1, 2], [3]]))
        rows = stored(m, 0, [1, 2, 3])[1]
        grad = torch.ones(out.shape)
        grad[0, 1] = float("nan")  # bag 0: keys 1 and 2
        out.backward(grad)  # optimizer step 1: no warning yet
        out = m(*bags([[3], [3]]))
        out.backward(torch.ones(out.shape))  # step 2: finite
    assert m.nonfinite_grads.tolist() == [0]
    assert [(r, s) for r, s, _ in m._counts_in_flight if r == "_count_nonfinite"] == [("_count_nonfinite", 1),
                                                                                      ("_count_nonfinite", 2)]
    with pytest.warns(RuntimeWarning, match=r"2 rows got a non-finite \(NaN / inf\) gradient at optimizer step 1; "
                                            r"their updates were skipped") as w:
        assert m.table_stats()["t0"]["nonfinite_grads"] == 2  # table_stats waits for every count
    assert len([x for x in w if "non-finite" in str(x.message)]) == 1
    assert m._counts_in_flight == []
    after = stored(m, 0, [1, 2, 3])[1]
    assert torch.equal(after[:2], rows[:2])  # keys 1 and 2 kept their rows
    assert not torch.equal(after[2], rows[2])  # key 3 was updated twice
