"""Checkpoints, incremental dumps and the inference export see every row of a
cached table, in its cache and in its backing store (a FileStore), against
an all-in-memory reference trained on the same batches: a cached module's
dump loads into an all-in-memory one (and back into a cached one) with
identical rows, optimizer state, scores and counters, and training then goes
on identically; incremental dumps return the same keys and values; the
frozen tables give the reference's eval outputs bit for bit."""
import pytest
import torch

from dynamicemb import DynamicEmbDump, DynamicEmbLoad
from dynamicemb import DynamicEmbScoreStrategy as S
from dynamicemb import EmbOptimType
from dynamicemb.incremental_dump import incremental_dump
from dynamicemb.inference import InferenceEmbeddingTable
from dynamicemb.inference.convert import to_inference
from dynamicemb.tiers import FileStore
from tier_helpers import BUCKET, all_rows, batches, make_store, module, step

ADAM = EmbOptimType.ADAM


def _file_module(root, strategy=S.STEP):
    return module(ADAM, FileStore(str(root), bucket_capacity=BUCKET), strategy=strategy)


def _trained_pair(tmp_path, steps=30, strategy=S.STEP):
    """(reference, cached) trained alike; the cached one's rows in both tiers."""
    ref, cached = module(ADAM, strategy=strategy), _file_module(tmp_path / "store", strategy)
    for i, b in enumerate(batches(steps, seed=7)):
        if i == steps // 2:
            cached.flush()  # some rows in the file's committed snapshot, some appended since
        assert torch.equal(step(cached, b), step(ref, b))
    stats = cached.table_stats()["t0"]
    assert stats["cache_rows"] > 0 and stats["store_rows"] > 4 * stats["cache_rows"]
    return ref, cached


def _scores(m, t):
    return {k: s for b in m.storage.export_rows(t) for k, s in zip(b.keys.tolist(), b.scores.tolist())}


def _assert_same_tables(got, want):
    assert (got.step, got.optimizer_step) == (want.step, want.optimizer_step)
    for t in range(2):
        g, w = all_rows(got, t), all_rows(want, t)
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w), f"t{t}"
        assert _scores(got, t) == _scores(want, t), f"t{t}"


def _go_on(a, b, steps=8):
    for i, batch in enumerate(batches(steps, seed=8)):
        assert torch.equal(step(a, batch), step(b, batch)), f"step {i}"


def test_a_cached_modules_dump_loads_into_an_all_in_memory_one(tmp_path):
    ref, cached = _trained_pair(tmp_path)
    DynamicEmbDump(str(tmp_path / "dump"), cached)
    plain = module(ADAM, strategy=S.STEP)
    DynamicEmbLoad(str(tmp_path / "dump"), plain)
    _assert_same_tables(plain, ref)
    _go_on(plain, ref)
    _assert_same_tables(plain, ref)


def test_dump_and_load_round_trip_through_cached_modules(tmp_path):
    """reference -> dump -> cached (a fresh FileStore) and cached -> dump ->
    cached: every row lands in the store, and training goes on as the reference."""
    ref, cached = _trained_pair(tmp_path)
    DynamicEmbDump(str(tmp_path / "from_ref"), ref)
    DynamicEmbDump(str(tmp_path / "from_cached"), cached)
    for dump in ("from_ref", "from_cached"):
        fresh = _file_module(tmp_path / f"fresh_{dump}")
        DynamicEmbLoad(str(tmp_path / dump), fresh)
        _assert_same_tables(fresh, ref)
        stats = fresh.table_stats()["t0"]
        assert stats["cache_rows"] == 0 and stats["store_rows"] == stats["size"] == len(all_rows(ref, 0))
    _go_on(fresh, ref)  # the last one, and the reference, go on alike
    _assert_same_tables(fresh, ref)
    # A load replaces everything a cached module held, in both tiers.
    DynamicEmbLoad(str(tmp_path / "from_cached"), fresh)
    plain = module(ADAM, strategy=S.STEP)
    DynamicEmbLoad(str(tmp_path / "from_cached"), plain)
    _assert_same_tables(fresh, plain)


def _tiers(m, t):
    s = m.table_stats()[f"t{t}"]
    return s["cache_rows"], s["store_rows"]


@pytest.mark.parametrize("kind", ["host", "file"])
def test_a_full_cached_tables_own_dump_loads_back_whole(tmp_path, kind):
    """Trained past its maximum, a cached table holds its store's room plus
    its cache's rows (more than max_capacity). Its dump loads back into the
    same module: the store's rows first while it has room, the rest into the
    cache (a load used to put every row into the store, and refused the
    table's own dump)."""
    def fresh(name):
        store = make_store(kind, tmp_path / name)
        return module(ADAM, store, cache_rows=256, strategy=S.STEP, max_capacity=1024)
    m = fresh("a")
    for b in batches(40, seed=5):
        step(m, b)
    before = [(all_rows(m, t), _scores(m, t), _tiers(m, t)) for t in range(2)]
    for rows, _, (cache, store) in before:
        assert cache == 256 and store > 1000 and len(rows) == cache + store  # both tiers full: > max_capacity
    DynamicEmbDump(str(tmp_path / "dump"), m)
    n = fresh("b")
    DynamicEmbLoad(str(tmp_path / "dump"), n)
    for t, (rows, scores, tiers) in enumerate(before):
        got = all_rows(n, t)
        assert got.keys() == rows.keys() and all(torch.equal(got[k], rows[k]) for k in rows), f"t{t}"
        cache, store = _tiers(n, t)
        assert _scores(n, t) == scores and cache <= 256 and cache + store == sum(tiers), f"t{t}"


@pytest.mark.parametrize("strategy", [S.STEP, S.TIMESTAMP])
def test_incremental_dump_sees_both_tiers(tmp_path, strategy):
    ref, cached = _trained_pair(tmp_path, strategy=strategy)
    # The threshold: the next step (STEP), or the clock now (TIMESTAMP: one clock for both modules here).
    threshold = ref.step + 1 if strategy == S.STEP else ref.storage.now(0)
    for b in batches(6, seed=9):
        assert torch.equal(step(cached, b), step(ref, b))
    got, got_next = incremental_dump(cached, threshold)
    want, want_next = incremental_dump(ref, threshold)
    store_keys = {k for keys, _, _ in cached.storage.store.items("t0") for k in keys.tolist()}
    for name in ("t0", "t1"):
        g = dict(zip(got[name][0].tolist(), got[name][1]))
        w = dict(zip(want[name][0].tolist(), want[name][1]))
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w), name
        assert 0 < len(w) < len(all_rows(ref, 0))
    cache_keys = set(got["t0"][0].tolist()) - store_keys
    assert cache_keys and set(got["t0"][0].tolist()) & store_keys  # keys from both tiers
    if strategy == S.STEP:
        assert got_next == want_next == {"t0": ref.step + 1, "t1": ref.step + 1}


def test_inference_export_reads_both_tiers(tmp_path):
    ref, cached = _trained_pair(tmp_path)
    ids = torch.cat([batches(1, seed=7)[0][0][:96], torch.arange(30000, 30032)])  # unseen keys too
    offsets = torch.arange(0, ids.numel() + 1, 8)
    ref.eval()
    want = ref(ids, offsets)
    assert torch.equal(to_inference(cached)(ids, offsets), want)
    DynamicEmbDump(str(tmp_path / "dump"), cached)
    frozen = InferenceEmbeddingTable.from_dump(str(tmp_path / "dump"), mean_divisor="length")
    assert torch.equal(frozen(ids, offsets), want)
    cached.eval()
    assert torch.equal(cached(ids, offsets), want)


def test_a_flush_that_makes_the_full_store_evict_warns(tmp_path):
    """A cached table holds its store's rows plus its cache's; a flush keeps
    only what the store holds, so with the store full it evicts (counted in
    'evicted') and says so, naming the table and the count."""
    m = module(ADAM, make_store("host"), cache_rows=256, strategy=S.STEP, max_capacity=1024, tables=1)
    for b in batches(40, seed=5, tables=1):
        step(m, b)
    before = m.table_stats()["t0"]
    assert before["size"] > 1024
    with pytest.warns(RuntimeWarning, match=r"flush\(\) of tables \['t0'\]: their stores were full.*\{'t0': \d+\}"):
        m.flush()
    after = m.table_stats()["t0"]
    assert after["size"] == before["size"] - (after["evicted"] - before["evicted"]) and after["cache_rows"] == 0


@pytest.mark.parametrize("kind", ["host", "file"])
def test_loaded_access_times_survive_the_cache_evicting_them(tmp_path, kind):
    """A (TIMESTAMP, LFU) cached table's dump loaded back on the same clock:
    every access time as saved, also for the rows the load put into the
    cache and the cache later evicts to the store (their times came from a
    copy the load left stale: 0), so incremental_dump still finds them."""
    def fresh(name):
        return module(ADAM, make_store(kind, tmp_path / name), cache_rows=256, strategy=(S.TIMESTAMP, S.LFU),
                      max_capacity=1024)  # trained past it: a load fills the store's room, the rest goes to the cache

    def times(m):
        return {k: s for b in m.storage.export_rows(0) for k, s in zip(b.keys.tolist(), b.timestamps.tolist())}
    m = fresh("a")
    for b in batches(40, seed=3):
        step(m, b)
    saved = times(m)
    DynamicEmbDump(str(tmp_path / "dump"), m)
    n = fresh("b")
    DynamicEmbLoad(str(tmp_path / "dump"), n)
    assert times(n) == saved and _tiers(n, 0)[0] > 0
    other = [(ids + 10**6, offsets) for ids, offsets in batches(10, seed=4)]  # keys the dump does not hold
    for b in other:
        step(n, b)
    now = times(n)
    kept = [k for k in saved if k in now]
    assert len(kept) > _tiers(n, 0)[0]  # loaded keys now in the store, evicted there from the cache
    assert {k: now[k] for k in kept} == {k: saved[k] for k in kept}
