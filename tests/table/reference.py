"""A pure-Python model of ScoredHashTable (API.md §6), written from the spec
and not from the C++ code, so that every observable result can be predicted
exactly: which slot a key takes, which key is evicted, counters, export order.

The model mirrors the public Python API (scores given as None / int / list,
`now` standing for the table's clock) and keeps one list per slot field.
"""
from typing import List, Optional, Sequence, Tuple

MASK64 = (1 << 64) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# Slot states, by digest: 0 never used, 1 erased (tombstone), >= 2 live.
EMPTY, ERASED = 0, 1

# Strategy codes (DynamicEmbScoreStrategy; 5 is the (TIMESTAMP, LFU) pair).
TIMESTAMP, STEP, CUSTOMIZED, LFU, NO_EVICTION, TIMESTAMP_LFU = range(6)
# Per-key insert outcomes (InsertResult).
INSERTED, ASSIGNED, EVICTED, FAILED = range(4)


def fmix64(k: int) -> int:
    """MurmurHash3's 64-bit finalizer on an unsigned 64-bit value."""
    k &= MASK64
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & MASK64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & MASK64
    k ^= k >> 33
    return k


def key_hash(key: int) -> int:
    return fmix64(key & MASK64)  # the key's two's-complement bits


def bucket_in_table(h: int, num_buckets: int) -> int:
    return (h * num_buckets) >> 64  # multiply-shift: the high bits pick the bucket


def digest_of(h: int) -> int:
    d = (h >> 32) & 0xFF
    return d + 2 if d < 2 else d  # 0 and 1 are slot states, never digests


def _sat(v: int) -> int:
    return max(INT64_MIN, min(INT64_MAX, v))


class RefTable:
    def __init__(self, bucket_counts: Sequence[int], bucket_capacity: int, strategy: int):
        self.cap = bucket_capacity
        self.strategy = strategy
        self.num_tables = len(bucket_counts)
        self._set_layout(bucket_counts)
        n = self.tb[-1] * self.cap
        self.keys = [0] * n
        self.digests = [EMPTY] * n
        self.scores = [0] * n
        self.ts = [0] * n  # kept by the (TIMESTAMP, LFU) pair only
        self.sizes = [0] * self.num_tables
        self.counters = [[0, 0, 0] for _ in range(self.num_tables)]  # inserted, evicted, failed
        self.held = set()  # slots held by the last insert call

    def _set_layout(self, bucket_counts: Sequence[int]) -> None:
        self.bucket_counts = list(bucket_counts)
        self.tb = [0]
        for b in bucket_counts:
            self.tb.append(self.tb[-1] + b)  # table t owns buckets [tb[t], tb[t+1])

    # ---- placement ---------------------------------------------------------------

    def bucket_of(self, key: int, t: int) -> int:
        return self.tb[t] + bucket_in_table(key_hash(key), self.bucket_counts[t])

    def _find(self, base: int, key: int) -> int:
        for s in range(base, base + self.cap):
            if self.digests[s] >= 2 and self.keys[s] == key:
                return s
        return -1

    def _first_free(self, base: int) -> int:
        for s in range(base, base + self.cap):
            if self.digests[s] < 2:
                return s
        return -1

    def table_of_slot(self, slot: int) -> int:
        b = slot // self.cap
        return next(t for t in range(self.num_tables) if self.tb[t] <= b < self.tb[t + 1])

    # ---- scores -------------------------------------------------------------------

    def _counts(self) -> bool:
        return self.strategy in (LFU, TIMESTAMP_LFU)

    def _key_scores(self, scores, n: int, now: int, step: int) -> List[int]:
        """The per-key score argument of a call, from the API's `scores`."""
        s = self.strategy
        if s in (TIMESTAMP, NO_EVICTION):
            return [now] * n
        if s == STEP:
            return [step if scores is None else scores] * n
        if s == CUSTOMIZED:
            return [scores] * n if isinstance(scores, int) else list(scores)
        if scores is None:
            return [1] * n  # one access
        return [scores] * n if isinstance(scores, int) else list(scores)

    def _on_insert(self, ks: int) -> int:
        return ks  # clock, step, given score or first frequency alike

    def _on_access(self, old: int, ks: int) -> int:
        return _sat(old + ks) if self._counts() else ks

    # ---- operations -----------------------------------------------------------------

    def _tids(self, tids, n: int) -> List[int]:
        if tids is None:
            return [0] * n
        return [tids] * n if isinstance(tids, int) else list(tids)

    def lookup(self, keys, tids=None) -> Tuple[List[int], List[bool]]:
        tids = self._tids(tids, len(keys))
        idx = [self._find(self.bucket_of(k, t) * self.cap, k) for k, t in zip(keys, tids)]
        return idx, [i >= 0 for i in idx]

    def lookup_refresh(self, keys, tids=None, scores=None, now=0, step=0):
        tids = self._tids(tids, len(keys))
        kss = self._key_scores(scores, len(keys), now, step)
        idx = []
        for k, t, ks in zip(keys, tids, kss):
            s = self._find(self.bucket_of(k, t) * self.cap, k)
            if s >= 0:
                self.scores[s] = self._on_access(self.scores[s], ks)
                self.ts[s] = now
            idx.append(s)
        return idx, [i >= 0 for i in idx]

    def insert(self, keys, tids=None, scores=None, now=0, step=0, evict=True, same_call=False, hold_stored=False):
        """Returns (indices, results, evicted [(key, table id, index, score)]).
        `evict`: a bool or per-table bools; a table that may not evict fails
        the key instead. `same_call` continues the previous insert: the slots
        it held stay held. `hold_stored`: the keys stored when the call
        begins go first, then the others, each group in input order."""
        tids = self._tids(tids, len(keys))
        kss = self._key_scores(scores, len(keys), now, step)
        evictable = [evict] * self.num_tables if isinstance(evict, bool) else list(evict)
        if not same_call:
            self.held = set()
        held = self.held  # slots placed or found by this call: never evicted by it
        order = list(range(len(keys)))
        if hold_stored:
            stored = [self._find(self.bucket_of(k, t) * self.cap, k) >= 0 for k, t in zip(keys, tids)]
            order = [i for i in order if stored[i]] + [i for i in order if not stored[i]]
        idx, res, evicted = [None] * len(keys), [None] * len(keys), []
        for i in order:
            out = self._insert_one(keys[i], tids[i], kss[i], now, evictable, held, evicted)
            idx[i], res[i] = out
        if hold_stored:  # listed in the evicting keys' input order, as the op lists them
            pos = {idx[i]: i for i in range(len(keys)) if res[i] == EVICTED}
            evicted.sort(key=lambda e: pos[e[2]])
        return idx, res, evicted

    def _insert_one(self, k, t, ks, now, evictable, held, evicted):
        """One key of insert: (its index, its result)."""
        base = self.bucket_of(k, t) * self.cap
        s = self._find(base, k)
        if s >= 0:
            self.scores[s] = self._on_access(self.scores[s], ks)
            r = ASSIGNED
        else:
            s, r = self._first_free(base), INSERTED
            if s < 0 and self.strategy != NO_EVICTION and evictable[t]:
                free = [j for j in range(base, base + self.cap) if j not in held]
                if free:
                    s = min(free, key=lambda j: (self.scores[j], j))
                    evicted.append((self.keys[s], t, s, self.scores[s]))
                    r = EVICTED
            if s < 0:
                self.counters[t][2] += 1
                return -1, FAILED
            self.keys[s], self.digests[s] = k, digest_of(key_hash(k))
            self.scores[s] = self._on_insert(ks)
            self.counters[t][0] += 1
            if r == INSERTED:
                self.sizes[t] += 1
            else:
                self.counters[t][1] += 1
        self.ts[s] = now
        held.add(s)
        return s, r

    def erase(self, keys, tids=None) -> List[bool]:
        tids = self._tids(tids, len(keys))
        out = []
        for k, t in zip(keys, tids):
            s = self._find(self.bucket_of(k, t) * self.cap, k)
            if s >= 0:
                self.digests[s] = ERASED
                self.sizes[t] -= 1
            out.append(s >= 0)
        return out

    def export(self, threshold: Optional[int] = None, table_id: Optional[int] = None):
        """[(key, table id, index, score)] of the live slots, in slot order."""
        lo, hi = 0, len(self.keys)
        if table_id is not None:
            lo, hi = self.tb[table_id] * self.cap, self.tb[table_id + 1] * self.cap
        filt = self.ts if self.strategy == TIMESTAMP_LFU else self.scores
        return [
            (self.keys[s], self.table_of_slot(s), s, self.scores[s])
            for s in range(lo, hi)
            if self.digests[s] >= 2 and (threshold is None or filt[s] >= threshold)
        ]

    def grow(self, new_bucket_counts: Sequence[int]) -> Tuple[List[int], List[int]]:
        """Rebuild with each table's bucket count times an integer; live slots
        are re-inserted in old slot order, each new bucket filling from slot 0.
        Returns (old indices, new indices) in old slot order."""
        old = (self.keys, self.digests, self.scores, self.ts, list(self.tb), self.bucket_counts)
        okeys, odig, osc, ots, otb, ocounts = old
        for o, n in zip(ocounts, new_bucket_counts):
            assert n % o == 0, "the model grows by integer factors only"
        self._set_layout(new_bucket_counts)
        n = self.tb[-1] * self.cap
        self.keys, self.digests, self.scores, self.ts = [0] * n, [EMPTY] * n, [0] * n, [0] * n
        fill = [0] * self.tb[-1]
        moves = ([], [])
        for s in range(len(okeys)):
            if odig[s] < 2:
                continue
            t = next(t for t in range(self.num_tables) if otb[t] <= s // self.cap < otb[t + 1])
            b = self.bucket_of(okeys[s], t)
            k = self.bucket_counts[t] // ocounts[t]
            old_local = s // self.cap - otb[t]
            # Old bucket b0 spreads only over new buckets k*b0 .. k*b0+k-1.
            assert k * old_local <= b - self.tb[t] < k * old_local + k
            d = b * self.cap + fill[b]
            fill[b] += 1
            self.keys[d], self.digests[d], self.scores[d], self.ts[d] = okeys[s], odig[s], osc[s], ots[s]
            moves[0].append(s)
            moves[1].append(d)
        self.held = {d for s, d in zip(*moves) if s in self.held}  # held slots stay held where they move
        return moves

    def reset_counters(self) -> None:
        self.counters = [[0, 0, 0] for _ in range(self.num_tables)]
