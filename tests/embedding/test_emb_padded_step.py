"""The padded training step (no host sync on CUDA): emb_unique_padded is
emb_unique plus padding, table_insert's key_count leaves the padding out,
and a module whose steps deduplicate padded trains exactly as one whose
steps do not (same outputs, rows, scores and counters). On the CPU the
padded step is forced (it is the default on CUDA), so every CPU run checks
its semantics; the `device` fixture runs the module tests on CUDA too."""
import sys

import pytest
import torch

from dynamicemb import (DynamicEmbCheckMode, DynamicEmbScoreStrategy, FrequencyAdmissionStrategy, InsertResult,
                        KVCounter, ScoredHashTable, rules)
from dynamicemb._ops import ops
from dynamicemb.rules import OFFSETS_RECORD_LEN
from emb_helpers import make_module, random_batch, stored_scores
from op_checks import generate_opcheck_tests, opcheck_every_call

FEATURE_TABLE = [0, 1, 0]
NO_BAD = 2**63 - 1  # the record's "no decreasing position" (bag_checks.h kNoBadOffset)


@opcheck_every_call
@pytest.mark.parametrize("n_bags", [0, 40, 3000], ids=["empty", "one-part", "64-parts"])
def test_unique_padded_is_unique_then_padding(n_bags):
    gen = torch.Generator().manual_seed(5)
    indices, offsets = random_batch(gen, FEATURE_TABLE, [500, 300], batch=n_bags, max_len=4)
    want = ops.emb_unique(indices, offsets, FEATURE_TABLE, 2)
    keys, tids, inverse, counts, num_unique, record = ops.emb_unique_padded(indices, offsets, FEATURE_TABLE, 2)
    n, G = indices.numel(), want[0].numel()
    assert num_unique.tolist() == [G]
    for got, exact, pad in ((keys, want[0], 0), (tids, want[1], 0), (counts, want[3], 0)):
        assert got.shape == (n,)
        assert torch.equal(got[:G], exact) and (got[G:] == pad).all()
    assert torch.equal(inverse, want[2])
    assert record.tolist() == [NO_BAD, 0, n, 0, 0, n]  # the CPU checked at once
    ops.emb_offsets_verdict(record)


def test_every_padded_call_checks_its_offsets(device):
    # Even offsets checked before: a retried bad tensor must raise again (the
    # padded call counts them as checked before its record is read).
    gen = torch.Generator().manual_seed(6)
    indices, offsets = random_batch(gen, FEATURE_TABLE, [500, 300], batch=40, max_len=4, device=device)
    first = ops.emb_unique_padded(indices, offsets, FEATURE_TABLE, 2)
    again = ops.emb_unique_padded(indices, offsets, FEATURE_TABLE, 2)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert again[5].tolist() == [NO_BAD, 0, indices.numel(), 0, 0, indices.numel()]


# "decreasing twice": both backends name the first position (CUDA's flag_min, the CPU's keep_first).
BAD_OFFSETS = {"start": [1, 2, 4, 4], "end": [0, 2, 4, 3], "decreasing": [0, 3, 2, 4],
               "decreasing twice": [0, 3, 2, 4, 3, 4, 4]}


def offsets_record(off, n):
    """The record bag_checks.h describes, of offsets `off` (a list) over n indices."""
    j = next((j for j in range(len(off) - 1) if off[j + 1] < off[j]), None)
    record = [NO_BAD if j is None else j, off[0], off[-1], 0 if j is None else off[j],
              0 if j is None else off[j + 1], n]
    assert len(record) == OFFSETS_RECORD_LEN
    return record


@pytest.mark.parametrize("bad", sorted(BAD_OFFSETS))
def test_offsets_verdict_gives_uniques_error(bad):
    # The record's verdict against emb_unique's own check of the same offsets.
    indices, offsets = torch.arange(4), torch.tensor(BAD_OFFSETS[bad])
    with pytest.raises(RuntimeError) as exact:
        ops.emb_unique(indices, offsets, FEATURE_TABLE, 2)
    with pytest.raises(RuntimeError) as padded:  # the CPU checks at once
        ops.emb_unique_padded(indices, offsets, FEATURE_TABLE, 2)
    with pytest.raises(RuntimeError) as verdict:
        ops.emb_offsets_verdict(torch.tensor(offsets_record(offsets.tolist(), indices.numel())))
    assert str(verdict.value) == str(exact.value) == str(padded.value)
    assert bad.split()[0][:5] in str(exact.value)


@pytest.mark.parametrize("bad", sorted(BAD_OFFSETS))
def test_a_padded_calls_offsets_are_checked_again_by_an_exact_one(bad, device):
    # Until its record is read, a padded call's offsets count as checked only
    # for the kernels that clamp them: emb_unique and the eval forward on the
    # same tensor still check them at once. (The CPU's padded call raises.)
    indices, offsets = torch.arange(4, device=device), torch.tensor(BAD_OFFSETS[bad], device=device)
    with pytest.raises(RuntimeError) as want:
        ops.emb_unique(indices.cpu(), offsets.cpu(), FEATURE_TABLE, 2)
    if indices.is_cuda:
        record = ops.emb_unique_padded(indices, offsets, FEATURE_TABLE, 2)[5]
        assert record.tolist() == offsets_record(BAD_OFFSETS[bad], 4)
    else:
        with pytest.raises(RuntimeError):
            ops.emb_unique_padded(indices, offsets, FEATURE_TABLE, 2)
    with pytest.raises(RuntimeError) as exact:
        ops.emb_unique(indices, offsets, FEATURE_TABLE, 2)
    m = make_module([4, 4], feature_table_map=FEATURE_TABLE, device=device).eval()
    with pytest.raises(RuntimeError) as served:
        m(indices, offsets)
    assert str(want.value) in str(exact.value) and str(want.value) in str(served.value)


@pytest.mark.parametrize("bags", [0, 5], ids=["no-bags", "empty-bags"])
def test_padded_unique_of_no_index(bags, device):
    # Nothing to group: padding of length 0 and a record that passes (on
    # CUDA made without waiting, with no bag or with empty ones).
    offsets = torch.zeros(len(FEATURE_TABLE) * bags + 1, dtype=torch.int64, device=device)
    out = ops.emb_unique_padded(torch.zeros(0, dtype=torch.int64, device=device), offsets, FEATURE_TABLE, 2)
    assert [t.numel() for t in out[:4]] == [0, 0, 0, 0] and out[4].tolist() == [0]
    assert out[5].tolist() == [NO_BAD, 0, 0, 0, 0, 0]
    ops.emb_offsets_verdict(out[5].cpu())


def test_offsets_verdict_refuses_a_bad_record():
    with pytest.raises(RuntimeError, match="offsets_record must be"):
        ops.emb_offsets_verdict(torch.zeros(3, dtype=torch.int64))


# ---- table_insert's key_count --------------------------------------------------------------

def _twin_tables(strategy, device):
    """Two identical tables of 2 logical tables, small enough to fill buckets."""
    return [ScoredHashTable([64, 256], bucket_capacity=16, score_strategy=strategy, num_tables=2, device=device)
            for _ in range(2)]


def _members(t, scores=True):
    names = ("slot_keys", "slot_digests", "slot_epochs", "sizes", "counters") + (("slot_scores",) if scores else ())
    return [getattr(t, m).cpu() for m in names]


@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.STEP, DynamicEmbScoreStrategy.LFU,
                                      DynamicEmbScoreStrategy.CUSTOMIZED, DynamicEmbScoreStrategy.NO_EVICTION],
                         ids=lambda s: s.name)
def test_insert_leaves_the_keys_past_key_count_out(strategy, device):
    # The reference: the same calls on a twin table with only the keys before the count.
    gen = torch.Generator().manual_seed(int(strategy))
    plain, padded = _twin_tables(strategy, device)
    clock = rules.score_is_clock(int(strategy))  # scores from the clock differ between the twins' calls
    for step in range(1, 5):
        n, m = 400, 300 - 60 * step  # the later calls overfill the small table: evictions or failures
        keys = torch.randint(-1000, 1000, (n,), generator=gen).to(device)
        tids = (torch.rand(n, generator=gen) < 0.3).long().to(device)
        scores = None if clock else step if strategy == DynamicEmbScoreStrategy.STEP else \
            torch.randint(1, 5, (n,), generator=gen).to(device)
        want = plain.insert(keys[:m], tids[:m], scores=scores[:m] if isinstance(scores, torch.Tensor) else scores)
        got = padded.insert(keys, tids, scores=scores, key_count=torch.tensor([m], device=device))
        assert torch.equal(got.indices[:m].cpu(), want.indices.cpu())
        assert torch.equal(got.results[:m].cpu(), want.results.cpu())
        assert (got.indices[m:] == -1).all() and (got.results[m:] == InsertResult.ASSIGNED).all()
        for a, b in zip(_members(padded, not clock), _members(plain, not clock)):
            assert torch.equal(a, b)
        assert torch.equal(got.evicted.keys.cpu(), want.evicted.keys.cpu())
    assert plain.counters.sum() > 0 and (plain.counters[:, 1:].sum() > 0)  # evicted or failed keys


def test_table_ids_past_key_count_are_checked_by_a_later_call(device):
    # The padding's table ids are not placed, so a padded insert does not
    # count its table ids as checked: the same tensor in a call without
    # key_count has them checked (on CUDA, where passing checks are recorded).
    t = ScoredHashTable([32, 32], bucket_capacity=16, num_tables=2, device=device)
    keys, tids = torch.arange(4, device=device), torch.tensor([0, 1, 7, 9], device=device)
    t.insert(keys, tids, key_count=torch.tensor([2], device=device))
    assert t.size() == 2
    with pytest.raises(RuntimeError, match=r"table id 7 \(key position 2\) is out of range \[0, 2\)"):
        t.insert(keys, tids)


def test_insert_refuses_a_bad_key_count():
    t = ScoredHashTable(64, bucket_capacity=16)
    for bad, msg in ((torch.tensor([1, 2]), "one count"), (torch.tensor([1.0]), "key_count")):
        with pytest.raises(RuntimeError, match=msg):
            t.insert(torch.arange(4), key_count=bad)


# ---- the module's padded step --------------------------------------------------------------------

def _pair(device, pooling="SUM", **opts):
    """Two identical modules, the second with padded steps (CUDA's default, forced on the CPU)."""
    mods = [make_module([8, 4], pooling=pooling, feature_table_map=FEATURE_TABLE, max_capacity=256, device=device,
                        optimizer="adam", **opts) for _ in range(2)]
    mods[0]._pads_unique = lambda indices: False
    mods[1]._pads_unique = lambda indices: True
    return mods


@pytest.mark.filterwarnings("ignore:dynamicemb.*could not be stored")  # the same failures in both, counted
def test_padded_steps_train_as_exact_ones(device):
    gen = torch.Generator().manual_seed(11)
    exact, padded = _pair(device, score_strategy=DynamicEmbScoreStrategy.LFU)
    for step in range(6):  # 800 and 600 keys into 256 rows each: evictions from the second step on
        indices, offsets = random_batch(gen, FEATURE_TABLE, [800, 600], batch=64, max_len=5, device=device)
        outs = []
        for m in (exact, padded):
            out = m(indices, offsets)
            out.pow(2).sum().backward()
            outs.append(out.detach().cpu())
        assert torch.equal(outs[0], outs[1])
    _assert_same_tables(exact, padded)
    assert exact.table_stats()["t0"]["evicted"] > 0 and exact.table_stats()["t0"]["failed"] > 0


def _assert_same_tables(exact, padded):
    assert exact.table_stats() == padded.table_stats()
    for t in range(2):
        assert stored_scores(exact, t) == stored_scores(padded, t)
        batches = [list(m.storage.export_rows(t)) for m in (exact, padded)]
        for part in ("keys", "values", "optimizer_state"):
            a, b = (torch.cat([getattr(x, part) for x in bs]).cpu() for bs in batches)
            assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:dynamicemb.*could not be stored")
def test_padded_steps_with_weights_and_interleaved_forwards(device):
    # MEAN bags with learned per-sample weights, and two forwards before
    # their backwards (the second evicts rows the first returned: the first
    # backward finds its keys' rows again, the padding staying without one).
    gen = torch.Generator().manual_seed(12)
    exact, padded = _pair(device, pooling="MEAN", score_strategy=DynamicEmbScoreStrategy.STEP)
    for _ in range(3):
        batches = [random_batch(gen, FEATURE_TABLE, [800, 600], batch=64, max_len=5, device=device)
                   for _ in range(2)]
        weights = [torch.rand(b[0].numel(), generator=gen).to(device) for b in batches]
        grads = {}
        for name, m in (("exact", exact), ("padded", padded)):
            psw = [w.clone().requires_grad_() for w in weights]
            outs = [m(i, o, w) for (i, o), w in zip(batches, psw)]
            for out in reversed(outs):
                out.pow(2).sum().backward()
            grads[name] = [w.grad.cpu() for w in psw] + [out.detach().cpu() for out in outs]
        for a, b in zip(grads["exact"], grads["padded"]):
            assert torch.equal(a, b)
    _assert_same_tables(exact, padded)


def test_which_steps_pad():
    m = make_module([4], max_capacity=64)
    cuda_like = type("Indices", (), {"device": torch.device("cuda")})()  # only the device type is read
    assert m._pads_unique(cuda_like) and not m._pads_unique(torch.empty(0))  # on CUDA only
    assert not make_module([4], max_capacity=64, init_capacity=16)._pads_unique(cuda_like)  # may grow
    assert not make_module([4], max_capacity=64, safe_check_mode=DynamicEmbCheckMode.ERROR)._pads_unique(cuda_like)
    admits = make_module([4], max_capacity=64, admit_strategy=FrequencyAdmissionStrategy(threshold=2),
                         admission_counter=KVCounter(64))
    assert not admits._pads_unique(cuda_like)
    grows = make_module([4], max_capacity=64, init_capacity=16)
    for m in (admits, grows):  # refused where no padded step is taken (a table that may grow: at its insert)
        with pytest.raises(ValueError, match="padded keys"):
            m.storage.find_or_insert(torch.arange(3), torch.zeros(3, dtype=torch.int64),
                                     torch.ones(3, dtype=torch.int64), 1, key_count=torch.tensor([2]))
    assert grows.table_stats()["t0"]["size"] == 0  # refused before anything was stored


@pytest.mark.parametrize("bad", sorted(BAD_OFFSETS))
def test_a_padded_step_with_bad_offsets_raises(bad, device):
    # The CPU raises in the forward; CUDA reads the record later (here when
    # table_stats waits for it), its kernels reading the offsets clamped.
    m = make_module([4, 4], feature_table_map=FEATURE_TABLE, device=device)
    m._pads_unique = lambda indices: True
    indices, offsets = torch.arange(4, device=device), torch.tensor(BAD_OFFSETS[bad], device=device)
    with pytest.raises(RuntimeError) as exact:
        ops.emb_unique(indices.cpu(), offsets.cpu(), FEATURE_TABLE, 2)
    for _ in range(2):  # the same bad tensor again: raises again
        with pytest.raises(RuntimeError) as padded:
            m(indices, offsets).sum().backward()
            m.table_stats()
        assert str(exact.value) in str(padded.value)


def test_bad_offsets_of_a_padded_step_raise_naming_it():
    m = make_module([4, 4], feature_table_map=FEATURE_TABLE)
    record = torch.tensor([NO_BAD, 0, 5, 0, 0, 6])
    with pytest.raises(RuntimeError, match=r"offsets end at 5 but there are 6 indices \(features .*training step 7"):
        m._check_offsets(record, 7, stacklevel=1)


generate_opcheck_tests(sys.modules[__name__])
