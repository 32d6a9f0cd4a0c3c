"""Admission, and the (TIMESTAMP, LFU) score, with caching=True train bit
for bit as the same options without a cache (a cache far smaller than the
keys, so rows go to the backing store and come back): the same outputs at
every step, the same rows, optimizer state, scores (LFU counts) and
admission counts at the end. Access times are clock readings, so they
cannot match another run's: each key's is checked against the clock
around the step that last accessed it, and it comes back exactly from the
store (a flush moves every row there)."""
import pytest
import torch

from dynamicemb import DynamicEmbInitializerArgs, DynamicEmbInitializerMode
from dynamicemb import DynamicEmbScoreStrategy as S
from dynamicemb import EmbOptimType, FrequencyAdmissionStrategy, KVCounter
from tier_helpers import BATCH, all_rows, batches, make_store, module, step

PAIR = (S.TIMESTAMP, S.LFU)


def _admission(init=None):
    return dict(admit_strategy=FrequencyAdmissionStrategy(2, initializer_args=init),
                admission_counter=KVCounter(1 << 15))


def _entries(m, t):
    """{key: (score, access time or None)} of table t, both tiers."""
    out = {}
    for b in m.storage.export_rows(t):
        ts = b.timestamps.tolist() if b.timestamps is not None else [None] * b.keys.numel()
        for k, s, a in zip(b.keys.tolist(), b.scores.tolist(), ts):
            assert k not in out, f"key {k} is in two places"
            out[k] = (s, a)
    return out


def _counts(m, t):
    adm = m.storage.admission_counter(t)
    return {k: c for keys, counts in adm.export() for k, c in zip(keys.tolist(), counts.tolist())}


def _same_tables(cached, ref):
    for t in range(2):
        want, got = all_rows(ref, t), all_rows(cached, t)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), f"t{t}: rows"
        assert {k: s for k, (s, _) in _entries(cached, t).items()} == \
            {k: s for k, (s, _) in _entries(ref, t).items()}, f"t{t}: scores"
        if ref.storage.admission_counter(t) is not None:
            assert _counts(cached, t) == _counts(ref, t), f"t{t}: admission counts"


@pytest.mark.filterwarnings("ignore:.*cannot hold one step's rows")  # a prefetch's keys may overflow it: fine here
@pytest.mark.parametrize("what, store_kind, prefetch", [
    ("admission", "host", False), ("admission", "dict", True), ("timestamp_lfu", "file", False),
    ("timestamp_lfu", "host", True), ("both", "host", True), ("both", "file", False)])
def test_cached_equals_all_in_memory(tmp_path, store_kind, prefetch, what):
    opts = {}
    if what != "timestamp_lfu":
        opts.update(_admission(DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL, std_dev=0.1)))
    opts["score_strategy"] = S.STEP if what == "admission" else PAIR  # (TIMESTAMP's scores are clock readings)
    ref = module(EmbOptimType.ADAM, **opts)
    cached = module(EmbOptimType.ADAM, make_store(store_kind, tmp_path), cache_rows=128, **opts)
    clocks, last = [], {}
    for i, b in enumerate(batches(40)):
        if prefetch:
            cached.prefetch(*b)
        before = cached.storage.now(0)
        assert torch.equal(step(cached, b), step(ref, b)), f"step {i}"
        clocks.append((before, cached.storage.now(0)))
        for k in b[0][:BATCH].tolist():  # t0's ids (the first feature)
            last[k] = i
    stats = cached.table_stats()["t0"]
    # Rows went to the store and came back (more write-backs than rows there now, none lost).
    assert stats["write_backs"] > stats["store_rows"] > 0 and stats["evicted"] == 0, stats
    assert stats["admission_rejected"] == ref.table_stats()["t0"]["admission_rejected"]
    assert (stats["admission_rejected"] > 0) == (what != "timestamp_lfu")
    _same_tables(cached, ref)
    if what != "admission":
        # Each key's access time: read by the step that last accessed it.
        for k, (_, ts) in _entries(cached, 0).items():
            lo, hi = clocks[last[k]]
            assert lo <= ts <= hi, f"key {k}: access time {ts} outside step {last[k]}'s [{lo}, {hi}]"
        # A flush moves every row to the store: scores and access times come back exactly.
        before = _entries(cached, 0)
        cached.flush()
        assert cached.table_stats()["t0"]["cache_rows"] == 0 and _entries(cached, 0) == before
        for b in batches(5, seed=9):  # training on after the flush: still the same
            assert torch.equal(step(cached, b), step(ref, b))
        _same_tables(cached, ref)


def test_timestamps_survive_a_reopened_file_store(tmp_path):
    """A persistent store (storage_path) keeps the access times of its rows
    as ages against its clock, as it keeps clock scores."""
    path = str(tmp_path / "store")
    m = module(storage_path=path, cache_rows=128, strategy=PAIR)
    for b in batches(20):
        step(m, b)
    before = _entries(m, 0)
    m.close()
    again = module(storage_path=path, cache_rows=128, strategy=PAIR)
    after = _entries(again, 0)
    assert after.keys() == before.keys() and all(after[k][0] == s for k, (s, _) in before.items())
    # Every access time moved by the same amount (ages as at the close), by no less than the time since.
    shifts = {after[k][1] - ts for k, (_, ts) in before.items()}
    assert len(shifts) == 1 and shifts.pop() >= 0
    again.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_access_times_ride_in_rows_bit_for_bit(dtype):
    """Any int64 (NaN bit patterns of the row's dtype included) comes back
    from a stored row exactly, for one row (a view at an odd offset) or many."""
    from types import SimpleNamespace

    from dynamicemb import rules
    from dynamicemb.tiers.access_times import AccessTimes
    ht = SimpleNamespace(strategy=rules.TIMESTAMP_LFU, slot_timestamps=torch.zeros(16, dtype=torch.int64))
    times = AccessTimes([rules.TIMESTAMP_LFU], [True], [5], dtype, [(ht, [0])], [True])
    g = torch.Generator().manual_seed(0)
    ts = torch.cat([torch.randint(-2**62, 2**62, (40,), generator=g), torch.tensor([-1, 0, 2**63 - 1, -2**63]),
                    torch.tensor([0x7FF8000000000001, 0x7FC00001FFFF7E01])])  # NaN patterns
    rows = torch.randn(ts.numel(), 5, generator=g).to(dtype)
    stored = times.join(0, rows, ts, 0)
    assert stored.shape == (ts.numel(), 5 + 8 // rows.element_size())
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for at in (slice(None), slice(3, 4), slice(7, 8)):
        back, got = times.split(0, stored[at])
        assert torch.equal(got, ts[at]) and torch.equal(back.view(bits), rows[at].view(bits))
