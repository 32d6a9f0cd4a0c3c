"""FileStore on its own, against a Python model of its content ({key: (row,
score)} per table): reopening gives the last flush; a crash (simulated: the
process stops at an fsync and its files are closed unflushed) at every
sync point of a flush that compacts leaves the old or the new flush, never a
mix, and no leftovers after the reopen; compaction keeps every row; the
memory map follows appends; bad reopens fail naming the table and the file."""
import json
import os
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamicemb import DynamicEmbScoreStrategy as S
from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions, EmbOptimType
from dynamicemb.tiers import FileStore
from dynamicemb.tiers import file_store as fs
from dynamicemb.tiers import prefault
from tier_helpers import BUCKET, all_rows, batches, module, step

TABLES = {"t0": (5, torch.float32), "t1": (3, torch.bfloat16)}
MAX_ROWS = 1 << 14


def _rows(keys: torch.Tensor, version: int, width: int, dtype) -> torch.Tensor:
    """Small integers (exact in bfloat16), different per key, column and version."""
    return ((keys % 61).unsqueeze(1) + torch.arange(width) * 64 + version).to(dtype)


class Model:
    """What the store should hold: {table: {key: (row, score)}}."""

    def __init__(self):
        self.tables = {n: {} for n in TABLES}

    def put(self, store, name, keys, version):
        width, dtype = TABLES[name]
        rows, scores = _rows(keys, version, width, dtype), keys * 3 + version
        assert store.put(name, keys, rows, scores) == 0
        for k, r, s in zip(keys.tolist(), rows, scores.tolist()):
            self.tables[name][k] = (r, s)

    def take(self, store, name, keys):
        found, rows, scores = store.take(name, keys)
        assert bool(found.all())
        for k, r, s in zip(keys.tolist(), rows, scores.tolist()):
            want = self.tables[name].pop(k)
            assert torch.equal(r, want[0]) and s == want[1]

    def snapshot(self):
        return {n: dict(t) for n, t in self.tables.items()}


def _open(root) -> FileStore:
    store = FileStore(str(root), bucket_capacity=BUCKET)
    for name, (width, dtype) in TABLES.items():
        store.open_table(name, width, dtype, MAX_ROWS)
    return store


def _assert_holds(store, want):
    for name, table in want.items():
        got = {}
        for keys, rows, scores in store.items(name, batch_size=300):
            assert rows.dtype == TABLES[name][1]
            for k, r, s in zip(keys.tolist(), rows, scores.tolist()):
                assert k not in got
                got[k] = (r, s)
        assert got.keys() == table.keys(), name
        assert all(torch.equal(got[k][0], table[k][0]) and got[k][1] == table[k][1] for k in table), name
        assert store.size(name) == len(table)
        # read (the path eval lookups take) agrees, and finds nothing else
        keys = torch.tensor(sorted(table) + [10**9], dtype=torch.int64)
        found, rows, scores = store.read(name, keys)
        assert found.tolist() == [True] * len(table) + [False]
        assert all(torch.equal(rows[i], table[k][0]) for i, k in enumerate(keys[:-1].tolist()))


def _current_files(root):
    """The files a store at rest holds: the manifest, and per table its
    committed snapshot and generation (and the lock files)."""
    manifest = json.load(open(os.path.join(root, fs.MANIFEST)))["tables"]
    want = {fs.MANIFEST, "manifest.lock"}
    for name, entry in manifest.items():
        with fs.safe_open(os.path.join(root, f"{name}.index.{entry['index']}.safetensors"), "pt") as f:
            gen = json.loads(f.metadata()["dynamicemb"])["generation"]
        want |= {f"{name}.index.{entry['index']}.safetensors", f"{name}.rows.{gen}", f"{name}.rows.lock"}
    return want


def _before_second_flush(root):
    """Flush 1 (state A), then churn that leaves t0 mostly garbage (state B,
    not flushed). Returns (store, A, B)."""
    store, model = _open(root), Model()
    for name in TABLES:
        model.put(store, name, torch.arange(0, 1000), 1)
    store.save_state("t0", {"flush": 1})
    store.flush()
    a = model.snapshot()
    model.take(store, "t0", torch.arange(0, 900))  # 900 garbage rows of 1200: t0 is compacted
    model.put(store, "t0", torch.arange(0, 100), 2)
    model.put(store, "t0", torch.arange(1000, 1100), 2)
    model.take(store, "t1", torch.arange(0, 100))  # t1 is not
    model.put(store, "t1", torch.arange(0, 50), 2)
    store.save_state("t0", {"flush": 2})
    return store, a, model.snapshot()


def test_reopen_holds_the_last_flush(tmp_path):
    store, _, b = _before_second_flush(tmp_path)
    store.flush()
    assert store.load_state("t0") == {"flush": 2} and store.load_state("t1") is None
    # Work after the last flush (puts, takes, a clear) is not kept.
    keys = torch.arange(5000, 5100)
    store.put("t0", keys, _rows(keys, 9, 5, torch.float32), torch.zeros(100, dtype=torch.int64))
    store.take("t0", torch.arange(0, 300))
    store.clear("t1")
    store.close()
    again = _open(tmp_path)
    _assert_holds(again, b)
    assert again.load_state("t0") == {"flush": 2}
    assert set(os.listdir(tmp_path)) == _current_files(tmp_path)


class _Crash(Exception):
    pass


def test_a_crash_at_any_sync_point_of_a_flush_leaves_the_old_or_the_new_flush(tmp_path, monkeypatch):
    """The process stops at the n-th fsync of flush 2 (which compacts t0),
    for every n (its files are then closed, nothing more written, as when
    it is killed): the reopened store holds flush 1 if the manifest was not
    yet replaced, else flush 2, and the reopen leaves only current files."""
    outcomes = []
    real_fsync, real_replace = os.fsync, os.replace
    for n in range(1, 50):
        root = tmp_path / f"crash{n}"
        store, a, b = _before_second_flush(root)
        calls, committed = [0], [False]

        def fsync(fd):
            calls[0] += 1
            if calls[0] == n:
                raise _Crash()
            real_fsync(fd)

        def replace(src, dst):
            real_replace(src, dst)
            committed[0] |= str(dst).endswith(fs.MANIFEST)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        try:
            store.flush()
            crashed = False
        except _Crash:
            crashed = True
        finally:
            monkeypatch.undo()
        store.close()
        again = _open(root)
        _assert_holds(again, b if committed[0] else a)
        assert again.load_state("t0") == {"flush": 2 if committed[0] else 1}
        assert set(os.listdir(root)) == _current_files(root)
        again.close()
        outcomes.append(committed[0])
        if not crashed:
            break
    # Both outcomes were seen; flush 2 compacted t0 (its rows are now generation 1).
    assert outcomes.count(False) >= 4 and outcomes.count(True) >= 2, outcomes
    assert os.path.exists(root / "t0.rows.1") and not os.path.exists(root / "t0.rows.0")


def test_compaction_keeps_every_row_and_removes_the_old_generation(tmp_path):
    store, model = _open(tmp_path), Model()
    model.put(store, "t0", torch.arange(0, 2000), 1)
    store.flush()
    model.take(store, "t0", torch.arange(0, 900))  # 900 of 2000 rows garbage: no compaction
    store.flush()
    assert os.path.exists(tmp_path / "t0.rows.0") and store._file("t0").rows == 2000
    model.take(store, "t0", torch.arange(900, 1100))  # now 1100 of 2000
    model.put(store, "t0", torch.arange(0, 10), 3)  # and 1110 of 2010
    store.flush()
    assert store._file("t0").rows == 910 == store.size("t0")  # the live rows only
    assert {f for f in os.listdir(tmp_path) if f.startswith("t0.rows.")} == {"t0.rows.1", "t0.rows.lock"}
    _assert_holds(store, model.snapshot())
    model.put(store, "t0", torch.arange(10, 20), 4)  # appended after the compacted rows
    _assert_holds(store, model.snapshot())
    store.flush()
    store.close()
    _assert_holds(_open(tmp_path), model.snapshot())


def test_puts_overwrite_only_garbage_the_committed_flush_does_not_address(tmp_path):
    """Once more than half of a rows file is garbage, puts overwrite garbage
    rows before appending: those freed since the last flush that it did not
    commit at once, those it committed only after the next flush. A store
    closed unflushed (a crash) reopens at its last flush all the same."""
    store, model = _open(tmp_path), Model()
    t0 = store._file("t0")
    model.put(store, "t0", torch.arange(0, 1000), 1)
    model.take(store, "t0", torch.arange(0, 600))  # never committed: free at once
    model.put(store, "t0", torch.arange(2000, 2100), 1)  # 600 of 1000 rows garbage: reused
    assert (t0.rows, t0.garbage) == (1000, 500)
    store.flush()  # 500 of 1000: no compaction
    model.take(store, "t0", torch.arange(600, 1000))  # committed: not overwritten before the next flush
    model.put(store, "t0", torch.arange(3000, 3600), 2)  # 500 reused, 100 appended
    assert (t0.rows, t0.garbage) == (1100, 400)
    _assert_holds(store, model.snapshot())
    store.flush()  # 400 of 1100: no compaction; rows 600..999's are free now
    b = model.snapshot()
    model.take(store, "t0", torch.arange(3000, 3200))  # committed by this flush
    model.put(store, "t1", torch.arange(0, 50), 2)  # (another table: its own rows)
    model.put(store, "t0", torch.arange(4000, 4300), 3)  # into rows 600..999's
    assert (t0.rows, t0.garbage) == (1100, 300)
    _assert_holds(store, model.snapshot())
    store.close()  # unflushed: as after a crash
    _assert_holds(_open(tmp_path), b)


def test_a_reserved_table_does_not_grow_its_index(tmp_path):
    store, model = _open(tmp_path), Model()
    store.reserve("t0", 8192)  # (buckets of 16: 3000 keys would overflow some of 4096 slots)
    slots = store._index.ht.capacities()
    assert slots[store._tid["t0"]] >= 8192
    model.put(store, "t0", torch.arange(0, 3000) * 7919, 1)
    assert store._index.ht.capacities() == slots  # no rehash while the keys came
    _assert_holds(store, model.snapshot())
    store.flush()
    store.close()
    again = _open(tmp_path)
    again.reserve("t0", 16384)  # holding keys: nothing to reserve, they stay
    _assert_holds(again, model.snapshot())


def test_appends_fault_in_the_pages_ahead_of_them_and_remaps_void_old_requests(tmp_path, monkeypatch):
    """The prefaulter is asked for the pages past each append, within the
    current map; a request for a map that was remapped (or closed) since is
    dropped, not run on memory that may be gone."""
    monkeypatch.setattr(prefault, "AHEAD", 1 << 16)
    monkeypatch.setattr(fs, "_MIN_MAP_BYTES", 64)
    calls = []

    def madvise(addr, length, advice):
        calls.append((addr, length, advice))
        return 0

    p = prefault.prefaulter()
    if not p.enabled:
        pytest.skip("no prefaulter on this platform")
    monkeypatch.setattr(p, "_madvise", madvise)
    f = fs._RowsFile(str(tmp_path / "rows"), 4, torch.float32, 1024, fresh=True)  # 16 KiB: 4 pages
    with f.lock:  # the prefaulter waits: both requests are queued before it runs either
        f.write(0, torch.ones(100, 4))  # a request for the map it has now: its pages 0-3
        first = f.generation
        f.write(100, torch.ones(1500, 4))  # grows to 2048 rows: remapped (the first request is void), pages 6-7
        assert f.generation == first + 1 and f.capacity == 2048
    deadline = time.time() + 10
    while not calls and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert all(advice == prefault.Prefaulter.MADV_POPULATE_WRITE for _, _, advice in calls)
    # Only the request for the live map ran: its page of the last rows written, to its end.
    assert [(a - f.address, n) for a, n, _ in calls] == [(6 * 4096, 2 * 4096)], calls
    assert torch.equal(f.gather(torch.arange(1600)), torch.ones(1600, 4))
    f.close()


def test_reads_follow_appends_across_remaps(tmp_path, monkeypatch):
    """The rows file's map grows (by doubling) while rows are appended; every
    read sees every row put before it."""
    monkeypatch.setattr(fs, "_MIN_MAP_BYTES", 64)
    store, model = _open(tmp_path), Model()
    for i in range(12):
        keys = torch.arange(i * 97, (i + 1) * 97)
        model.put(store, "t1", keys, i)
        _assert_holds(store, {"t1": model.tables["t1"]})
        if i % 4 == 3:
            model.take(store, "t1", keys[:50])
    assert store._file("t1").file.capacity >= 12 * 97


def test_reopen_with_another_width_or_dtype_names_the_table(tmp_path):
    store, model = _open(tmp_path), Model()
    model.put(store, "t0", torch.arange(0, 10), 1)
    store.flush()
    store.close()
    for width, dtype in ((6, torch.float32), (5, torch.float16)):
        other = FileStore(str(tmp_path))
        with pytest.raises(ValueError, match=r"table 't0'.*width 5 \(torch.float32\).*dim, dtype and optimizer"):
            other.open_table("t0", width, dtype, MAX_ROWS)
        other.close()
    _assert_holds(_open(tmp_path), {"t0": model.tables["t0"]})  # the failed opens changed nothing


def test_a_table_open_twice_is_refused(tmp_path):
    store = _open(tmp_path)
    other = FileStore(str(tmp_path))
    with pytest.raises(RuntimeError, match="table 't0' of the file store at .* is open in another FileStore"):
        other.open_table("t0", 5, torch.float32, MAX_ROWS)
    other.open_table("t2", 5, torch.float32, MAX_ROWS)  # another table of the same directory is fine
    store.close()
    other.open_table("t0", 5, torch.float32, MAX_ROWS)


def test_stores_sharing_a_directory_commit_their_own_tables(tmp_path):
    """Two modules' stores in one directory (one per module, distinct tables):
    each flush commits its own tables and keeps the other's."""
    one, two = FileStore(str(tmp_path)), FileStore(str(tmp_path))
    one.open_table("a", 4, torch.float32, MAX_ROWS)
    two.open_table("b", 4, torch.float32, MAX_ROWS)
    for i, (store, name) in enumerate(((one, "a"), (two, "b"), (one, "a"))):
        keys = torch.arange(i * 10, i * 10 + 10)
        store.put(name, keys, torch.full((10, 4), float(i)), keys)
        store.flush()
    one.close()
    two.close()
    again = FileStore(str(tmp_path))
    again.open_table("a", 4, torch.float32, MAX_ROWS)
    again.open_table("b", 4, torch.float32, MAX_ROWS)
    assert again.size("a") == 20 and again.size("b") == 10


def _damage_index(root):
    path = root / "t0.index.0.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a bit of the scores flipped
    path.write_bytes(bytes(data))
    return path, "fails its checksum"


def _truncate_index(root):
    path = root / "t0.index.0.safetensors"
    path.write_bytes(path.read_bytes()[:-20])
    return path, "cannot be read"


def _remove_index(root):
    path = root / "t0.index.0.safetensors"
    path.unlink()
    return path, "is missing"


def _truncate_rows(root):
    path = root / "t0.rows.0"
    with open(path, "r+b") as f:
        f.truncate(20 * 9)  # 9 of the 10 rows left
    return path, "needs 10 rows of 20 bytes"


def _damage_manifest(root):
    path = root / fs.MANIFEST
    path.write_text(path.read_text()[:-5])
    return path, "cannot be read"


@pytest.mark.parametrize("damage", [_damage_index, _truncate_index, _remove_index, _truncate_rows,
                                    _damage_manifest])
def test_a_damaged_store_fails_naming_the_table_and_the_file(tmp_path, damage):
    store, model = _open(tmp_path), Model()
    model.put(store, "t0", torch.arange(0, 10), 1)
    store.flush()
    store.close()
    path, what = damage(tmp_path)
    with pytest.raises(ValueError, match=f"{'' if damage is _damage_manifest else 'table .t0.: '}.*{path}.*{what}"):
        _open(tmp_path)


def _scores(store):
    return {k: s for keys, _, scores in store.items("t0") for k, s in zip(keys.tolist(), scores.tolist())}


def test_clock_scores_keep_their_ages_across_a_reopen(tmp_path):
    """TIMESTAMP scores are clock readings: a reopened store carries them to
    the clock of the reopening table, ages as at the flush (the time the
    store was closed does not count, as for a checkpoint load)."""
    m = module(store=FileStore(str(tmp_path), bucket_capacity=BUCKET))
    for b in batches(8):
        step(m, b)
    flush_started = m.storage.now(0)
    m.flush()
    before = _scores(m.storage.store)
    m.storage.store.close()
    time.sleep(0.2)
    m2 = module(store=FileStore(str(tmp_path), bucket_capacity=BUCKET))
    reopened_at = m2.storage.now(0)
    after = _scores(m2.storage.store)
    assert after.keys() == before.keys() and len(after) > 400
    shift = {after[k] - before[k] for k in after}
    assert len(shift) == 1  # one shift: the order and the gaps of the scores are kept
    # The scores moved on by the time from the flush to the reopen (the 0.2 s closed included).
    assert 0.2e9 <= shift.pop() <= reopened_at - flush_started


@pytest.mark.parametrize("strategy", [S.STEP, S.CUSTOMIZED])
def test_a_reopened_module_resumes_its_counters(tmp_path, strategy):
    """The module's step and optimizer step (Adam's bias correction) and the
    CUSTOMIZED score come back with the rows."""
    m = module(EmbOptimType.ADAM, FileStore(str(tmp_path), bucket_capacity=BUCKET), strategy=strategy)
    m.set_score(41)
    for b in batches(3):
        step(m, b)
    m.flush()
    m.storage.store.close()
    m2 = module(EmbOptimType.ADAM, FileStore(str(tmp_path), bucket_capacity=BUCKET), strategy=strategy)
    assert (m2.step, m2.optimizer_step, m2.storage.custom_scores) == (3, 3, [41, 41])


def test_a_store_reopened_by_another_sharding_is_refused(tmp_path):
    """A rank's store holds the keys routed to it: reopening it with another
    number of shards (or routing) would look keys up on the wrong ranks."""
    opts = dict(dim=4, max_capacity=4096, bucket_capacity=BUCKET, caching=True, global_hbm_for_values=512 * 4 * 4)
    m = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(storage_path=str(tmp_path), **opts)], ["t"])
    step(m, (torch.arange(100), torch.tensor([0, 100])))
    m.flush()
    m.storage.store.close()
    for other in (dict(num_shards=2), dict(dist_type="roundrobin")):
        with pytest.raises(ValueError, match=r"table 't'.*sharded over 1 ranks by 'hash_roundrobin'.*DynamicEmbDump"):
            BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(storage_path=str(tmp_path), **opts, **other)],
                                          ["t"])
    m = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(storage_path=str(tmp_path), **opts)], ["t"])
    assert m.table_stats()["t"]["size"] == 100


def test_a_store_reopened_by_another_score_strategy_is_refused(tmp_path):
    """Stored scores mean what the table's strategy says: an LFU count read as
    a TIMESTAMP clock reading (or the reverse) would evict the wrong rows."""
    opts = dict(dim=4, max_capacity=4096, bucket_capacity=BUCKET, caching=True, global_hbm_for_values=512 * 4 * 4)
    lfu = DynamicEmbTableOptions(storage_path=str(tmp_path), score_strategy=S.LFU, **opts)
    m = BatchedDynamicEmbeddingTables([lfu], ["t"])
    step(m, (torch.arange(100), torch.tensor([0, 100])))
    m.flush()
    m.storage.store.close()
    for other in (S.TIMESTAMP, S.STEP):  # ((TIMESTAMP, LFU) rows are wider: refused by their width)
        with pytest.raises(ValueError, match=r"table 't'.*scored by LFU; .*now scored by.*same score_strategy"):
            BatchedDynamicEmbeddingTables(
                [DynamicEmbTableOptions(storage_path=str(tmp_path), score_strategy=other, **opts)], ["t"])
    m = BatchedDynamicEmbeddingTables([lfu], ["t"])
    assert m.table_stats()["t"]["size"] == 100
    assert {s for b in m.storage.export_rows(0) for s in b.scores.tolist()} == {1}  # the counts, as stored


def test_a_store_reopened_with_another_dim_of_the_same_row_width_is_refused(tmp_path):
    """Dim 8 with SGD and dim 4 with Adagrad both store 8 columns: the store's
    width check passes, and half of each value would be read as Adagrad's
    accumulator."""
    from dynamicemb import EmbOptimType
    opts = dict(max_capacity=4096, bucket_capacity=BUCKET, caching=True, global_hbm_for_values=512 * 8 * 4,
                storage_path=str(tmp_path))
    m = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=8, **opts)], ["t"], optimizer=EmbOptimType.EXACT_SGD)
    step(m, (torch.arange(100), torch.tensor([0, 100])))
    m.flush()
    m.storage.store.close()
    with pytest.raises(ValueError, match=r"table 't': its backing store holds rows of dim 8 .* now has dim 4"):
        BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, **opts)], ["t"],
                                      optimizer=EmbOptimType.EXACT_ADAGRAD)
    m = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=8, **opts)], ["t"], optimizer=EmbOptimType.EXACT_SGD)
    assert m.table_stats()["t"]["size"] == 100


def test_a_refused_reopen_releases_the_store(tmp_path):
    """A module that fails to open over a storage_path closes the FileStore
    it made (its locks and maps), even while the error is still held."""
    opts = dict(dim=4, max_capacity=4096, bucket_capacity=BUCKET, caching=True, global_hbm_for_values=512 * 4 * 4)
    m = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(storage_path=str(tmp_path), **opts)], ["t"])
    step(m, (torch.arange(100), torch.tensor([0, 100])))
    m.flush()
    m.storage.store.close()
    with pytest.raises(ValueError, match="sharded over") as refused:
        BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(storage_path=str(tmp_path), num_shards=2, **opts)],
                                      ["t"])
    m = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(storage_path=str(tmp_path), **opts)], ["t"])
    assert refused.value is not None and m.table_stats()["t"]["size"] == 100


def _open_files(root) -> list:
    """This process's open files under root."""
    fds = "/proc/self/fd"
    paths = [os.path.realpath(os.path.join(fds, fd)) for fd in os.listdir(fds)]
    return [p for p in paths if p.startswith(os.path.realpath(str(root)))]


def test_a_rows_file_that_cannot_be_mapped_is_closed(tmp_path, monkeypatch):
    store = FileStore(str(tmp_path), bucket_capacity=BUCKET)

    def fail(*args, **kwargs):
        raise OSError("no address space")

    monkeypatch.setattr(fs.mmap, "mmap", fail)
    with pytest.raises(OSError, match="no address space") as err:
        store.open_table("t0", 5, torch.float32, MAX_ROWS)
    # Closed at once, not when the error (which holds the frames) goes.
    assert err.value is not None and not _open_files(tmp_path)


def test_close_writes_the_cache_back_and_frees_the_store_the_module_opened(tmp_path):
    """close(): a module whose storage_path made its store flushes, then
    releases the files (another module opens them at once, with every row);
    a store the user passed stays open."""
    m = module(storage_path=str(tmp_path / "own"))
    for b in batches(6):
        step(m, b)
    want = [all_rows(m, t) for t in range(2)]
    m.close()
    m2 = module(storage_path=str(tmp_path / "own"))  # was refused while the first held the table locks
    assert m2.storage.size(0) == 0  # every row came back from the store, none cached yet
    for t in range(2):
        got = all_rows(m2, t)
        assert got.keys() == want[t].keys() and all(torch.equal(got[k], want[t][k]) for k in got)
    m2.close()
    store = FileStore(str(tmp_path / "given"), bucket_capacity=BUCKET)
    m3 = module(store=store)
    step(m3, batches(1)[0])
    m3.close()
    assert store.size("t0") > 0  # flushed into it, and still open: the user closes it
    store.close()


_OPS = st.lists(st.tuples(st.sampled_from(["put", "put", "take", "take", "flush", "crash", "clear"]),
                          st.sampled_from(["t0", "t0", "t0", "t1"]), st.integers(0, 2**31 - 1)),
                min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, share=st.sampled_from([0.0, 0.5]))
def test_any_sequence_reopens_at_its_last_flush(tmp_path_factory, ops, share):
    """Puts, takes (which free rows for reuse), flushes (some compacting),
    clears and crashes (closed unflushed, then reopened) in any order: the
    store always holds what the model says, and a reopen what the last
    flush committed: no reused row was one the committed flush addresses.
    share 0: puts reuse garbage rows whenever there are some."""
    root = tmp_path_factory.mktemp("any")
    old_share = fs._GARBAGE_SHARE
    fs._GARBAGE_SHARE = share
    try:
        store, model = _open(root), Model()
        committed = model.snapshot()
        for version, (op, name, seed) in enumerate(ops, start=1):
            g = torch.Generator().manual_seed(seed)
            held = sorted(model.tables[name])
            if op == "put":
                keys = torch.randint(0, 3000, (int(torch.randint(1, 200, (1,), generator=g)),), generator=g)
                keys = keys.unique()
                keys = keys[~torch.isin(keys, torch.tensor(held, dtype=torch.int64))]
                if keys.numel():
                    model.put(store, name, keys, version)
            elif op == "take" and held:
                pick = torch.randperm(len(held), generator=g)[:max(1, len(held) // 2)]
                model.take(store, name, torch.tensor(held, dtype=torch.int64)[pick])
            elif op == "flush":
                store.flush()
                committed = model.snapshot()
            elif op == "clear":
                store.clear(name)
                model.tables[name] = {}
            elif op == "crash":
                store.close()
                store = _open(root)
                model.tables = {n: dict(t) for n, t in committed.items()}
            _assert_holds(store, model.snapshot())
        store.close()
        _assert_holds(_open(root), committed)
    finally:
        fs._GARBAGE_SHARE = old_share


def test_a_rows_file_that_cannot_grow_raises_naming_the_table_and_its_rows_stay(tmp_path, monkeypatch):
    """The rows file's space is allocated as it grows (a store through the
    map to a page the file system cannot back would kill the process with
    SIGBUS): a full file system raises an OSError naming the table before a
    row is written, and the rows put before stay readable."""
    monkeypatch.setattr(fs, "_MIN_MAP_BYTES", 64)
    store, model = _open(tmp_path), Model()
    model.put(store, "t1", torch.arange(0, 97), 1)
    f = store._file("t1").file
    st = os.stat(f.path)
    assert st.st_blocks * 512 >= st.st_size  # allocated, not sparse

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fs.os, "posix_fallocate", full)
    keys = torch.arange(1000, 1000 + 4 * f.capacity)
    with pytest.raises(OSError, match=r"table 't1': its rows file .*t1\.rows\.\d+ cannot grow.*No space left"):
        store.put("t1", keys, _rows(keys, 2, 3, torch.bfloat16), torch.zeros(keys.numel(), dtype=torch.int64))
    monkeypatch.undo()
    _assert_holds(store, {"t1": model.tables["t1"]})
