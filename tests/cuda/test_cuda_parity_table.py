"""CUDA kernels vs the CPU kernels (which define the semantics): a
ScoredHashTable on the device and one on the CPU, driven by the same sequence
of calls (inserts with evictions, failures, duplicate keys and several logical
tables under every score strategy; lookups with and without refresh; erase,
export, grow, counters), return identical indices, results, evicted entries,
sizes, counters and exports, and hold identical slots after every call.
Skipped without a GPU; DYNAMICEMB_PARITY_DEVICE=cpu runs them CPU against CPU
(cuda_parity.py)."""
import pytest
import torch

import dynamicemb.table as table_mod
from cuda_parity import DEV, PARITY_MARKS, same
from dynamicemb import DynamicEmbScoreStrategy as S
from dynamicemb import InsertResult as R
from dynamicemb import ScoredHashTable

pytestmark = PARITY_MARKS

STRATEGIES = {
    "timestamp": S.TIMESTAMP,
    "step": S.STEP,
    "customized": S.CUSTOMIZED,
    "lfu": S.LFU,
    "no_eviction": S.NO_EVICTION,
    "timestamp_lfu": (S.TIMESTAMP, S.LFU),
}
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


class _Clock:
    """Stands in for ScoredHashTable.now (the table clock: the GPU timer on
    CUDA): both tables of a call read the same (test-set) clock, so TIMESTAMP
    scores agree."""

    def __init__(self):
        self.now = 1_000_000

    def read(self, table=None) -> int:
        return self.now


def _dev(x):
    return x.to(DEV) if isinstance(x, torch.Tensor) else x


def _live(t):
    return t.slot_digests.cpu() >= 2  # table_rules.h: kFirstLiveDigest


class Twin:
    """The same table on the CPU (reference) and on DEV; every call runs on
    both at one clock reading, and everything observable is compared."""

    def __init__(self, name, capacities, bucket_capacity, clock):
        strategy = STRATEGIES[name]
        self.name, self.clock = name, clock
        self.num_tables = len(capacities)
        self.seen = set()  # InsertResult values seen, to check what a sequence covered
        self.ref = ScoredHashTable(capacities, bucket_capacity, strategy, num_tables=self.num_tables)
        self.dut = ScoredHashTable(capacities, bucket_capacity, strategy, num_tables=self.num_tables, device=DEV)
        self.check_state()

    def _both(self, op, *args, **kwargs):
        self.clock.now += 1_000
        a = getattr(self.ref, op)(*args, **kwargs)
        b = getattr(self.dut, op)(*(_dev(x) for x in args), **{k: _dev(v) for k, v in kwargs.items()})
        return a, b

    def _tids(self, tids):
        return None if self.num_tables == 1 else tids

    # ---- operations --------------------------------------------------------------

    def insert(self, keys, tids, scores=None, step=None, **kwargs):
        if step is not None:
            self.ref.step = self.dut.step = step
        a, b = self._both("insert", keys, self._tids(tids), scores=scores, **kwargs)
        same(a.indices, b.indices)
        same(a.results, b.results)
        self.seen |= set(a.results.tolist())
        for x, y in zip(a.evicted, b.evicted):
            same(x, y)
        self.check_state()
        return a

    def lookup(self, keys, tids, update_score=False, scores=None):
        a, b = self._both("lookup", keys, self._tids(tids), update_score=update_score, scores=scores)
        for x, y in zip(a, b):
            same(x, y)
        self.check_state()
        return a

    def refresh(self, indices, scores=None):
        self._both("refresh", indices, scores)
        self.check_state()

    def lookup_gather(self, keys, tids, values):
        a, b = self._both("lookup_gather", keys, values, self._tids(tids))
        for x, y in zip(a, b):
            same(x, y)
        return a

    def erase(self, keys, tids):
        a, b = self._both("erase", keys, self._tids(tids))
        same(a, b)
        self.check_state()
        return a

    def take(self, keys, tids):
        values = torch.arange(self.ref.slot_keys.numel()) * 7 - 3  # per-slot entries to return
        a, b = self._both("take", keys, self._tids(tids), values)
        for x, y in zip(a, b):
            same(x, y)
        self.check_state()
        return a

    def export(self, threshold=None, batch_size=1 << 16, table_id=None):
        self.clock.now += 1_000
        a = list(self.ref.export(threshold, batch_size, table_id))
        b = list(self.dut.export(threshold, batch_size, table_id))
        assert len(a) == len(b)
        for x, y in zip(a, b):
            for u, v in zip(x, y):
                same(u, v)
        return a

    def grow(self, new_capacity, table_id=None):
        a, b = self._both("grow", new_capacity, table_id)
        for x, y in zip(a, b):
            same(x, y)
        self.check_state()
        return a

    def reset_counters(self):
        self._both("reset_counters")
        self.check_state()

    def raises_alike(self, op, *args, **kwargs):
        """Both raise the same error (CPU message) and leave the slots alone."""
        msgs = []
        for t, dev in ((self.ref, False), (self.dut, True)):
            with pytest.raises(RuntimeError) as e:
                getattr(t, op)(*(_dev(x) if dev else x for x in args), **kwargs)
            msgs.append(str(e.value).splitlines()[0])
        assert msgs[0] == msgs[1]
        self.check_state()

    # ---- state -------------------------------------------------------------------

    def check_state(self):
        r, d = self.ref, self.dut
        same(r.table_buckets, d.table_buckets)
        same(r.slot_digests, d.slot_digests)  # live slots, tombstones and free slots
        live = _live(r)
        for name in ("slot_keys", "slot_scores", "slot_epochs"):
            same(getattr(r, name).cpu()[live], getattr(d, name).cpu()[live])
        if r.slot_timestamps.numel() or d.slot_timestamps.numel():
            same(r.slot_timestamps.cpu()[live], d.slot_timestamps.cpu()[live])
        same(r.sizes, d.sizes)
        same(r.counters, d.counters)
        assert r.capacities() == d.capacities()
        assert r.size() == d.size() == int(live.sum())
        for t in range(self.num_tables):
            assert r.get_counters(t) == d.get_counters(t)
            assert r.size(t) == d.size(t)


# ---- inputs -----------------------------------------------------------------------


def _scores(name, gen, n):
    """Per-key scores for the strategies that take them (small: many ties)."""
    if name in ("customized", "lfu", "timestamp_lfu"):
        return torch.randint(0, 6, (n,), generator=gen)
    return None


def _batch(gen, n, key_range, num_tables, extremes=True):
    """n keys with many duplicates (within and across tables)."""
    keys = torch.randint(-key_range, key_range, (n,), generator=gen)
    if extremes and n >= 8:
        keys[:4] = torch.tensor([I64_MIN, I64_MAX, 0, -1])
        keys[4:8] = keys[:4]  # the same keys again, in the same call
    tids = torch.randint(0, num_tables, (n,), generator=gen)
    return keys, tids


@pytest.mark.parametrize("name", list(STRATEGIES))
# b128: a tile's lanes hold the whole bucket (the CUDA insert's BucketRegs, the
# lookup's 16-byte digest loads); b256: buckets past what the registers hold.
@pytest.mark.parametrize("bucket_capacity,capacities",
                         [(16, [64]), (16, [32, 96, 16]), (32, [64, 128, 256]), (128, [256, 512, 128]), (256, [512])],
                         ids=["1table", "3tables-b16", "3tables-b32", "3tables-b128", "1table-b256"])
def test_table_sequence(name, bucket_capacity, capacities, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(table_mod.ScoredHashTable, "now", clock.read)
    gen = torch.Generator().manual_seed(len(capacities) * 100 + bucket_capacity + list(STRATEGIES).index(name))
    T = len(capacities)
    tw = Twin(name, capacities, bucket_capacity, clock)
    total = sum(capacities)

    # Fill past capacity: evictions (or failures without eviction), duplicates.
    for rnd in range(4):
        keys, tids = _batch(gen, total, 3 * total, T)
        kw = {}
        if name == "step":
            kw["step"] = 10 + rnd
        if name == "customized":
            kw["scores"] = _scores(name, gen, keys.numel()) if rnd % 2 == 0 else 7 + rnd
        elif name in ("lfu", "timestamp_lfu"):
            kw["scores"] = _scores(name, gen, keys.numel()) if rnd % 2 == 0 else None
        tw.insert(keys, tids, **kw)

    # Per-table eviction off: those tables' inserts into full buckets fail.
    keys, tids = _batch(gen, total, 4 * total, T)
    tw.insert(keys, tids, scores=_scores(name, gen, keys.numel()) if name != "step" else None,
              evict=[t % 2 == 1 for t in range(T)])
    # One call in two parts: what the first part placed is held in the second.
    keys, tids = _batch(gen, total // 2, 4 * total, T)
    tw.insert(keys, tids, scores=_scores(name, gen, keys.numel()) if name != "step" else None)
    keys, tids = _batch(gen, total, 4 * total, T)
    tw.insert(keys, tids, scores=_scores(name, gen, keys.numel()) if name != "step" else None, same_call=True)
    # Scalar scores, where a strategy takes them.
    keys, tids = _batch(gen, 40, 4 * total, T)
    if name in ("step", "customized", "lfu", "timestamp_lfu"):
        tw.insert(keys, tids, scores=3)
    # Empty input.
    tw.insert(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
              scores=torch.empty(0, dtype=torch.int64) if name in ("customized",) else None)

    # Lookups: present and absent keys, with and without refresh.
    present = torch.cat([b.keys for b in tw.export()])
    present_t = torch.cat([b.table_ids for b in tw.export()])
    absent, absent_t = _batch(gen, 50, 4 * total, T, extremes=False)
    # Truly absent: refresh takes distinct slots, and a stored key drawn again would
    # repeat its slot (the CPU applies both accesses in order, CUDA in parallel).
    stored = set(zip(present.tolist(), present_t.tolist()))
    new = torch.tensor([(k, t) not in stored for k, t in zip(absent.tolist(), absent_t.tolist())], dtype=torch.bool)
    absent, absent_t = absent[new], absent_t[new]
    keys, tids = torch.cat([present, absent]), torch.cat([present_t, absent_t])
    perm = torch.randperm(keys.numel(), generator=gen)
    keys, tids = keys[perm], tids[perm]
    tw.lookup(keys, tids)
    refresh_scores = None
    if name in ("customized", "lfu", "timestamp_lfu"):
        refresh_scores = _scores(name, gen, keys.numel())
    if name == "step":
        tw.ref.step = tw.dut.step = 99
    tw.lookup(keys, tids, update_score=True, scores=refresh_scores)
    slots, _ = tw.lookup(keys, tids)  # -1 for the absent ones
    tw.refresh(slots, refresh_scores)  # an access at slots found earlier
    dup = torch.cat([keys[:20], keys[:20]])  # the same key twice in one refresh
    tw.lookup(dup, torch.cat([tids[:20], tids[:20]]), update_score=True,
              scores=None if refresh_scores is None else torch.cat([refresh_scores[:20]] * 2))

    # Erase present and absent keys (tombstones), then insert into them.
    tw.erase(keys[::3], tids[::3])
    tw.erase(keys[::3], tids[::3])  # already gone
    tw.take(keys[1::3], tids[1::3])  # erase returning what left (CPU: one op; CUDA: lookup, erase)
    keys, tids = _batch(gen, total // 2, 4 * total, T)
    tw.insert(keys, tids, scores=_scores(name, gen, keys.numel()) if name != "step" else None)

    # Exports: whole, in small batches, with a threshold, per table.
    tw.export()
    tw.export(batch_size=bucket_capacity + 7)
    thr = {"timestamp": clock.now - 5_000, "step": 11, "customized": 4, "lfu": 3,
           "no_eviction": clock.now - 5_000, "timestamp_lfu": clock.now - 5_000}[name]
    tw.export(threshold=thr)
    for t in range(T):
        tw.export(table_id=t, batch_size=2 * bucket_capacity)

    # Grow one table, then all; the tables keep working after it.
    tw.grow(capacities[0] * 2, table_id=0)
    tw.grow([c * (2 if t % 2 else 4) for t, c in enumerate(tw.ref.capacities())])
    keys, tids = _batch(gen, 2 * total, 8 * total, T)
    tw.insert(keys, tids, scores=_scores(name, gen, keys.numel()) if name != "step" else None)
    tw.lookup(keys, tids)
    tw.export()

    tw.reset_counters()
    keys, tids = _batch(gen, total, 8 * total, T)
    tw.insert(keys, tids, scores=_scores(name, gen, keys.numel()) if name != "step" else None)

    # The sequence covered every outcome the strategy has.
    want = {R.INSERTED, R.ASSIGNED, R.FAILED} | ({R.EVICTED} if name != "no_eviction" else set())
    assert tw.seen == want


@pytest.mark.parametrize("name", ["timestamp", "lfu"])
def test_many_keys_per_bucket(name, monkeypatch):
    """Long runs of keys per bucket and many tiles: 20000 keys into 64 buckets."""
    clock = _Clock()
    monkeypatch.setattr(table_mod.ScoredHashTable, "now", clock.read)
    gen = torch.Generator().manual_seed(7)
    tw = Twin(name, [512, 512], 16, clock)
    for _ in range(3):
        keys, tids = _batch(gen, 20000, 5000, 2)
        tw.insert(keys, tids, scores=_scores(name, gen, keys.numel()))
        tw.lookup(keys, tids, update_score=True, scores=_scores(name, gen, keys.numel()))
    tw.erase(keys[::2], tids[::2])
    for dtype, dim in [(torch.float32, 64), (torch.float16, 7), (torch.bfloat16, 3)]:
        values = torch.randn(1024, dim, generator=gen).to(dtype)
        found = tw.lookup_gather(keys, tids, values)[2]
        assert 0 < int(found.sum()) < keys.numel()  # hits and misses (zero rows)
    tw.export(batch_size=100)
    tw.grow(2048)


def test_bad_table_ids_raise_like_cpu(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(table_mod.ScoredHashTable, "now", clock.read)
    tw = Twin("lfu", [32, 32], 16, clock)
    keys, tids = torch.arange(10), torch.tensor([0, 1] * 5)
    tw.insert(keys, tids)
    bad = tids.clone()
    bad[6] = 2  # one bad id: the reported position does not depend on the order of the checks
    tw.raises_alike("insert", keys, bad)
    tw.raises_alike("lookup", keys, bad)
    tw.raises_alike("lookup", keys, bad, update_score=True)
    tw.raises_alike("erase", keys, bad)
    bad[6] = -1
    tw.raises_alike("insert", keys, bad)
    tw.lookup(keys, tids)
