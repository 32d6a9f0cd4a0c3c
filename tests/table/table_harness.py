"""Drives a ScoredHashTable and the reference model together: every call runs
on both, and everything observable is compared (results, evictions, slot
state, sizes, counters), plus the checks that need no model (accounting
identities, stable indices)."""
from collections import Counter
from typing import Dict, List, Optional, Tuple
from unittest import mock

import torch

import dynamicemb.table as table_mod
from dynamicemb import DynamicEmbScoreStrategy as S
from dynamicemb import ScoredHashTable
from reference import ASSIGNED, EVICTED, FAILED, INSERTED, TIMESTAMP_LFU, RefTable

# Model strategy code -> the score_strategy argument of ScoredHashTable.
API_STRATEGY = {
    0: S.TIMESTAMP,
    1: S.STEP,
    2: S.CUSTOMIZED,
    3: S.LFU,
    4: S.NO_EVICTION,
    TIMESTAMP_LFU: (S.TIMESTAMP, S.LFU),
}


class _Clock:
    """Stands in for ScoredHashTable.now (the table clock): it reads whatever
    the test set, so TIMESTAMP scores are predictable."""

    def __init__(self):
        self.now = 0

    def read(self, table=None) -> int:
        return self.now


class Pair:
    def __init__(self, strategy: int, bucket_counts: List[int], bucket_capacity: int = 16, device: str = "cpu"):
        self.cap = bucket_capacity
        self.clock = _Clock()
        self.table = ScoredHashTable([b * bucket_capacity for b in bucket_counts], bucket_capacity,
                                     score_strategy=API_STRATEGY[strategy], num_tables=len(bucket_counts),
                                     device=device)
        self.device = self.table.device
        self.model = RefTable(bucket_counts, bucket_capacity, strategy)
        self.check_state()

    def _t(self, v):
        """A list argument as an int64 tensor on the table's device."""
        return torch.tensor(v, dtype=torch.int64, device=self.device) if isinstance(v, list) else v

    def _call(self, fn, *args, **kwargs):
        with mock.patch.object(table_mod.ScoredHashTable, "now", self.clock.read):
            return fn(*args, **kwargs)

    # ---- operations, each compared with the model --------------------------------

    def insert(self, keys: List[int], tids=None, scores=None, now: int = 0, step: int = 0, evict=True,
               same_call: bool = False, list_evicted: bool = True, hold_stored: bool = False):
        self.clock.now, self.table.step = now, step
        before = self.live()
        sizes0, ctr0 = self.table.sizes.tolist(), self.table.counters.tolist()
        out = self._call(self.table.insert, self._t(keys), self._t(tids), self._t(scores), evict=evict,
                         same_call=same_call, list_evicted=list_evicted, hold_stored=hold_stored)
        idx, res, ev = self.model.insert(keys, tids, scores, now=now, step=step, evict=evict, same_call=same_call,
                                         hold_stored=hold_stored)
        got_ev = list(zip(*(x.tolist() for x in out.evicted))) if out.evicted.keys.numel() else []
        assert out.indices.tolist() == idx
        assert out.results.tolist() == res
        assert got_ev == (ev if list_evicted else [])  # unlisted: the results alone say EVICTED
        self._check_insert_identities(keys, tids, out, sizes0, ctr0, list_evicted)
        # An evicted key may come back in the same call, in another slot.
        self.check_state(before, moved={(t, k) for k, t, _, _ in ev})
        return out

    def lookup(self, keys: List[int], tids=None, update_score=False, scores=None, now=0, step=0):
        self.clock.now, self.table.step = now, step
        before = self.live()
        idx, found = self._call(self.table.lookup, self._t(keys), self._t(tids), update_score, self._t(scores))
        if update_score:
            want = self.model.lookup_refresh(keys, tids, scores, now=now, step=step)
        else:
            want = self.model.lookup(keys, tids)
        assert (idx.tolist(), found.tolist()) == want
        self.check_state(before)
        return idx, found

    def erase(self, keys: List[int], tids=None):
        before = self.live()
        sizes0 = self.table.sizes.tolist()
        erased = self.table.erase(self._t(keys), self._t(tids)).tolist()
        assert erased == self.model.erase(keys, tids)
        # keys before - erased = keys after (per table)
        per_t = Counter(t for t, e in zip(self.model._tids(tids, len(keys)), erased) if e)
        assert self.table.sizes.tolist() == [s - per_t[t] for t, s in enumerate(sizes0)]
        self.check_state(before)
        return erased

    def take(self, keys: List[int], tids=None, with_values: bool = True):
        """erase through ScoredHashTable.take: the same keys leave, and it
        returns what they held (per-slot values: random ones; default: the
        slots)."""
        before = self.live()
        sizes0 = self.table.sizes.tolist()
        ts = self.model._tids(tids, len(keys))
        slots = [self.model._find(self.model.bucket_of(k, t) * self.cap, k) for k, t in zip(keys, ts)]
        scores = list(self.model.scores)
        erased = self.model.erase(keys, tids)
        n_slots = self.table.slot_keys.numel()
        values = torch.randint(-2**40, 2**40, (n_slots,), device=self.device) if with_values else None
        at, got, got_scores = self.table.take(self._t(keys), self._t(tids), values)
        want_at = [i for i, e in enumerate(erased) if e]
        vals = values.tolist() if with_values else list(range(n_slots))
        assert at.tolist() == want_at
        assert got.tolist() == [vals[slots[i]] for i in want_at]
        assert got_scores.tolist() == [scores[slots[i]] for i in want_at]
        per_t = Counter(ts[i] for i in want_at)
        assert self.table.sizes.tolist() == [s - per_t[t] for t, s in enumerate(sizes0)]
        self.check_state(before)
        return want_at

    def export(self, threshold: Optional[int] = None, batch_size: int = 1 << 16, table_id=None):
        got = []
        for b in self.table.export(threshold, batch_size, table_id):
            assert b.indices.tolist() == sorted(b.indices.tolist())  # slot order
            got += zip(b.keys.tolist(), b.table_ids.tolist(), b.indices.tolist(), b.scores.tolist())
        assert got == self.model.export(threshold, table_id)
        return got

    def grow(self, new_bucket_counts: List[int], table_id: Optional[int] = None):
        before = self.live()
        old_scores = self.table.slot_scores.clone()
        caps = [c * self.cap for c in new_bucket_counts]
        arg = caps[table_id] if table_id is not None else caps
        old_idx, new_idx = self.table.grow(arg, table_id)
        assert (old_idx.tolist(), new_idx.tolist()) == self.model.grow(new_bucket_counts)
        assert self.table.capacities() == caps
        # Every entry moved with its score; nothing lost.
        moved = dict(zip(old_idx.tolist(), new_idx.tolist()))
        assert sorted(moved) == sorted(i for i, _ in before.values())
        after = self.live()
        for k, (i, _) in before.items():
            assert after[k][0] == moved[i]
            assert int(self.table.slot_scores[moved[i]]) == int(old_scores[i])
        self.check_state()
        return old_idx, new_idx

    def reset_counters(self):
        self.table.reset_counters()
        self.model.reset_counters()
        self.check_state()

    # ---- checks ------------------------------------------------------------------

    def live(self) -> Dict[Tuple[int, int], Tuple[int, int]]:
        """{(table id, key): (slot, score)} read from the table's own tensors."""
        dig = self.table.slot_digests.tolist()
        keys, scores = self.table.slot_keys.tolist(), self.table.slot_scores.tolist()
        out = {}
        for s, d in enumerate(dig):
            if d >= 2:
                k = (self.model.table_of_slot(s), keys[s])
                assert k not in out, f"key {k} stored twice"
                out[k] = (s, scores[s])
        return out

    def check_state(self, before=None, moved=frozenset()):
        t, m = self.table, self.model
        dig = t.slot_digests.tolist()
        assert dig == m.digests
        live = [s for s, d in enumerate(dig) if d >= 2]
        keys, scores = t.slot_keys.tolist(), t.slot_scores.tolist()
        assert [keys[s] for s in live] == [m.keys[s] for s in live]
        assert [scores[s] for s in live] == [m.scores[s] for s in live]
        if m.strategy == TIMESTAMP_LFU:
            ts = t.slot_timestamps.tolist()
            assert [ts[s] for s in live] == [m.ts[s] for s in live]
        assert t.sizes.tolist() == m.sizes
        assert t.counters.tolist() == m.counters
        # sizes agree with the slots themselves, per table
        per_t = Counter(m.table_of_slot(s) for s in live)
        assert m.sizes == [per_t[i] for i in range(m.num_tables)]
        assert t.size() == len(live) and t.capacity() == len(dig)
        assert t.load_factor() == len(live) / len(dig)
        if before is not None:  # keys that stay keep their slot
            after = self.live()
            for k in before.keys() & after.keys() - moved:
                assert before[k][0] == after[k][0], f"key {k} moved"

    def _check_insert_identities(self, keys, tids, out, sizes0, ctr0, list_evicted=True):
        n = len(keys)
        res = out.results.tolist()
        idx = out.indices.tolist()
        tl = self.model._tids(tids, n)
        assert len(res) == n and set(res) <= {INSERTED, ASSIGNED, EVICTED, FAILED}
        if list_evicted:
            assert out.evicted.keys.numel() == res.count(EVICTED)
            assert out.evicted.indices.tolist() == [i for i, r in zip(idx, res) if r == EVICTED]
        assert all((i == -1) == (r == FAILED) for i, r in zip(idx, res))
        ctr = self.table.counters.tolist()
        sizes = self.table.sizes.tolist()
        for t in range(self.model.num_tables):
            c = Counter(r for r, tt in zip(res, tl) if tt == t)
            assert sum(c.values()) == tl.count(t)  # inserted + assigned + evicting + failed = n
            assert ctr[t][0] - ctr0[t][0] == c[INSERTED] + c[EVICTED]
            assert ctr[t][1] - ctr0[t][1] == c[EVICTED]
            assert ctr[t][2] - ctr0[t][2] == c[FAILED]
            # keys before + inserted - evicted = keys after
            assert sizes[t] == sizes0[t] + (c[INSERTED] + c[EVICTED]) - c[EVICTED]
        # Every stored key is found where the insert put it.
        ok = [i for i, r in enumerate(res) if r != FAILED]
        if ok:
            li, lf = self.table.lookup(self._t([keys[i] for i in ok]),
                                       None if tids is None else self._t([tl[i] for i in ok]))
            assert lf.all() and li.tolist() == [idx[i] for i in ok]
