"""The table rules one by one, with the expected outcome written out by hand
(and the reference model run alongside through Pair): placement, every score
strategy, victim choice, held keys, tombstones, grow, extreme keys."""
import random
import time

import pytest
import torch

from dynamicemb import DynamicEmbScoreStrategy as S
from dynamicemb import InsertResult as R
from dynamicemb import ScoredHashTable
from dynamicemb._ops import ops, table_arg
from table_harness import Pair
from reference import (CUSTOMIZED, INT64_MAX, INT64_MIN, LFU, NO_EVICTION, STEP, TIMESTAMP,
                       TIMESTAMP_LFU, bucket_in_table, digest_of, key_hash)

FILL = list(range(100, 116))  # 16 keys: fill a one-bucket table


def _results(out):
    return [R(r) for r in out.results.tolist()]


def _evicted(out):
    return list(zip(*(x.tolist() for x in out.evicted))) if out.evicted.keys.numel() else []


def test_placement_follows_hash_bucket_and_digest(device):
    p = Pair(STEP, [3, 5, 2], device=device)
    keys = list(range(-20, 20)) + [INT64_MIN, INT64_MAX]
    for t, nb in enumerate([3, 5, 2]):
        idx = p.insert(keys, t).indices.tolist()
        first = [0, 3, 8][t]
        for k, i in zip(keys, idx):
            if i < 0:
                continue
            h = key_hash(k)
            assert i // 16 == first + bucket_in_table(h, nb)
            assert int(p.table.slot_digests[i]) == digest_of(h)
    # Hash bits 32..39 equal to 0 or 1 would collide with the slot states:
    # such keys get digest 2 or 3 and are ordinary keys.
    low = [k for k in range(5000) if (key_hash(k) >> 32) & 0xFF < 2][:4]
    assert len(low) == 4
    p = Pair(STEP, [4], device=device)
    idx = p.insert(low).indices
    assert sorted(p.table.slot_digests[idx].tolist()) == sorted(((key_hash(k) >> 32) & 0xFF) + 2 for k in low)
    assert p.lookup(low)[1].all()


def test_inserts_fill_the_lowest_free_slot_in_input_order(device):
    p = Pair(STEP, [1], device=device)
    assert p.insert([7, 3, 9]).indices.tolist() == [0, 1, 2]
    assert p.insert([1]).indices.tolist() == [3]
    assert p.insert([3, 2]).indices.tolist() == [1, 4]


def test_duplicate_keys_in_a_batch(device):
    p = Pair(LFU, [1], device=device)
    out = p.insert([5, 5, 6, 5])
    assert _results(out) == [R.INSERTED, R.ASSIGNED, R.INSERTED, R.ASSIGNED]
    assert out.indices.tolist() == [0, 0, 1, 0]
    assert p.table.slot_scores[:2].tolist() == [3, 1]  # one access per occurrence
    assert p.table.get_counters() == {"inserted": 2, "evicted": 0, "failed": 0}
    assert p.table.size() == 2


def test_step_evicts_lowest_score_then_lowest_slot(device):
    p = Pair(STEP, [1], device=device)
    steps = [5, 3, 3, 7] + [9] * 12
    for k, s in zip(FILL, steps):
        p.insert([k], step=s)
    out = p.insert([1], step=20)
    assert _results(out) == [R.EVICTED] and _evicted(out) == [(101, 0, 1, 3)]
    out = p.insert([2], step=20)
    assert _evicted(out) == [(102, 0, 2, 3)]
    # A new key displaces the victim whatever its own score...
    out = p.insert([3], step=0)
    assert _evicted(out) == [(100, 0, 0, 5)]
    # ...and, lowest now, is the next victim.
    assert _evicted(p.insert([4], step=1)) == [(3, 0, 0, 0)]
    assert p.table.get_counters() == {"inserted": 20, "evicted": 4, "failed": 0}
    assert p.table.size() == 16


def test_equal_scores_evict_slot_zero_first(device):
    p = Pair(STEP, [1], device=device)
    p.insert(FILL, step=0)
    assert _evicted(p.insert([1], step=0)) == [(100, 0, 0, 0)]
    assert _evicted(p.insert([2], step=0)) == [(1, 0, 0, 0)]


def test_extreme_scores_evict_in_score_then_slot_order(device):
    # The CPU's vector victim search reads the slots it may not take as
    # INT64_MAX: live slots scored INT64_MAX must still go, after every lower
    # score, lowest slot first; the call's own keys (score 0) never.
    p = Pair(CUSTOMIZED, [1], device=device)
    scores = [INT64_MAX] * 16
    scores[5], scores[9], scores[12] = INT64_MIN, INT64_MAX - 1, -1
    p.insert(FILL, scores=scores)
    out = p.insert([1, 2, 3, 4, 5], scores=[0] * 5)
    assert _evicted(out) == [(105, 0, 5, INT64_MIN), (112, 0, 12, -1), (109, 0, 9, INT64_MAX - 1),
                             (100, 0, 0, INT64_MAX), (101, 0, 1, INT64_MAX)]
    out = p.insert(list(range(6, 23)), scores=INT64_MIN)
    assert [i for _, _, i, _ in _evicted(out)] == [0, 1, 5, 9, 12, 2, 3, 4, 6, 7, 8, 10, 11, 13, 14, 15]
    assert _results(out)[-1] == R.FAILED  # the 17th: all 16 slots held by the call


def test_timestamp_is_lru(device):
    p = Pair(TIMESTAMP, [1], device=device)
    for i, k in enumerate(FILL):
        p.insert([k], now=10 + i)
    p.lookup([100], update_score=True, now=50)  # refresh: 100 is now the newest
    p.lookup([101])  # a plain lookup does not touch the score
    assert int(p.table.slot_scores[1]) == 11
    p.insert([102], now=51)  # an insert of a present key refreshes too
    assert _evicted(p.insert([1], now=52)) == [(101, 0, 1, 11)]
    assert _evicted(p.insert([2], now=53)) == [(103, 0, 3, 13)]


def test_timestamp_reads_the_monotonic_clock():
    """Unpatched: the score of a TIMESTAMP insert is time.monotonic_ns() of the call."""
    t = ScoredHashTable(16, 16, S.TIMESTAMP)
    t0 = time.monotonic_ns()
    i1 = t.insert(torch.tensor([1])).indices
    t1 = time.monotonic_ns()
    i2 = t.insert(torch.tensor([2])).indices
    s1, s2 = int(t.scores_of(i1)), int(t.scores_of(i2))
    assert t0 <= s1 <= t1 <= s2 <= time.monotonic_ns()


def test_customized_scores_are_set_not_accumulated(device):
    p = Pair(CUSTOMIZED, [1], device=device)
    p.insert(FILL, scores=list(range(50, 66)))
    p.insert([100, 101], scores=[1, 70])  # access sets the given score
    assert p.table.slot_scores[:3].tolist() == [1, 70, 52]
    assert _evicted(p.insert([1], scores=99)) == [(100, 0, 0, 1)]
    p.lookup([102], update_score=True, scores=[0])
    assert _evicted(p.insert([2], scores=[99])) == [(102, 0, 2, 0)]
    with pytest.raises(ValueError, match="CUSTOMIZED score strategy needs scores"):
        p.table.insert(p._t([3]))


def test_lfu_counts_and_saturates(device):
    p = Pair(LFU, [1], device=device)
    p.insert(FILL)
    p.insert([100, 100, 101], scores=[2, 3, 1])
    p.lookup([102], update_score=True, scores=4)
    assert p.table.slot_scores[:4].tolist() == [6, 2, 5, 1]
    assert _evicted(p.insert([1])) == [(103, 0, 3, 1)]  # count 1; slot 3 lowest of ties
    # Counts saturate at the int64 limits instead of wrapping.
    p.lookup([100], update_score=True, scores=INT64_MAX)
    p.lookup([100, 101], update_score=True, scores=[INT64_MAX, INT64_MIN])
    p.lookup([101], update_score=True, scores=INT64_MIN)
    assert p.table.slot_scores[:2].tolist() == [INT64_MAX, INT64_MIN]


def test_no_eviction_fails_when_full_and_reuses_erased_slots(device):
    p = Pair(NO_EVICTION, [1], device=device)
    p.insert(FILL, now=1)
    out = p.insert([1, 100, 2], now=2)
    assert _results(out) == [R.FAILED, R.ASSIGNED, R.FAILED]
    assert out.indices.tolist() == [-1, 0, -1] and _evicted(out) == []
    assert p.table.get_counters() == {"inserted": 16, "evicted": 0, "failed": 2}
    p.erase([105])
    out = p.insert([1, 2], now=3)
    assert _results(out) == [R.INSERTED, R.FAILED] and out.indices.tolist() == [5, -1]


def test_timestamp_lfu_evicts_by_count_and_keeps_access_time(device):
    p = Pair(TIMESTAMP_LFU, [1], device=device)
    for i, k in enumerate(FILL):
        p.insert([k], scores=2, now=i)
    p.insert([115], now=40)  # the newest access, count 3
    p.lookup([100], update_score=True, now=30)  # the oldest key, now count 3
    p.insert([103], scores=-1, now=31)  # count 1: the least frequent
    assert p.table.timestamps_of(p._t([0, 3, 15])).tolist() == [30, 31, 40]
    assert _evicted(p.insert([1], now=41)) == [(103, 0, 3, 1)]
    assert _evicted(p.insert([2], now=42)) == [(1, 0, 3, 1)]
    # Export's threshold filters on the access time, not the count.
    assert [k for k, *_ in p.export(threshold=30)] == [100, 2, 115]
    with pytest.raises(ValueError, match="only by the \\(TIMESTAMP, LFU\\) strategy"):
        Pair(LFU, [1], device=device).table.timestamps_of(torch.tensor([0]))


def test_keys_held_by_the_call_are_never_evicted_by_it(device):
    p = Pair(STEP, [1], device=device)
    p.insert(FILL, step=1)
    p.insert([101], step=0)  # 101 now has the lowest score
    out = p.insert([101, 1], step=5)  # 101 is found first, so 1 evicts 100 instead
    assert _evicted(out) == [(100, 0, 0, 1)]
    # 16 keys placed or found, then one more: nothing may be evicted.
    out = p.insert(FILL[2:] + [1, 101, 2], step=6)
    assert _results(out)[-1] == R.FAILED and out.indices.tolist()[-1] == -1
    assert p.table.get_counters()["failed"] == 1
    # An empty table and 17 new keys in one call: the 17th fails.
    q = Pair(CUSTOMIZED, [1], device=device)
    out = q.insert(list(range(17)), scores=list(range(17)))
    assert _results(out) == [R.INSERTED] * 16 + [R.FAILED]


def test_epoch_wrap_forgets_which_call_held_a_slot(device):
    p = Pair(STEP, [1], device=device)
    p.insert(FILL, step=0)  # call epoch 1 marks every slot
    p.table._epoch = 254
    p.insert([], step=0)  # epoch 255, the last; the next call wraps to 1
    # Had the wrap kept the stale marks, every slot would look held by it.
    out = p.insert([1] + FILL, step=1)  # 1 evicts 100, 100 evicts 101, ...
    assert p.table._epoch == 1
    assert _results(out) == [R.EVICTED] * 16 + [R.FAILED]


def test_same_call_holds_its_slots_across_epoch_wraps(device):
    # 300 calls, each continued once with same_call, number their epochs
    # past the one-byte wrap: every call and continuation matches the model
    # (which holds a call's slots by call, not by epoch number).
    p = Pair(STEP, [2], device=device)
    rng = random.Random(7)
    for c in range(300):
        p.insert([rng.randrange(120) for _ in range(10)], step=c)
        p.insert([rng.randrange(120) for _ in range(10)], step=c, same_call=True)
    assert p.table._epoch == 300 - 255


def test_erase_leaves_tombstones_reused_before_eviction(device):
    p = Pair(STEP, [1], device=device)
    p.insert(FILL, step=0)
    assert p.erase([109, 103, 555, 109]) == [True, True, False, False]
    assert p.table.slot_digests[[3, 9]].tolist() == [1, 1]
    # Keys past a tombstone are still found; erased keys are not.
    idx, found = p.lookup([115, 103, 109])
    assert idx.tolist() == [15, -1, -1]
    out = p.insert([1, 2, 3], step=9)  # tombstones first (lowest first), then evict
    assert out.indices.tolist() == [3, 9, 0] and _results(out) == [R.INSERTED, R.INSERTED, R.EVICTED]
    assert p.table.size() == 16
    # Erasing every key then inserting reuses slots from 0 again.
    p.erase([k for (_, k) in p.live()])
    assert p.table.size() == 0 and p.insert([7, 8], step=1).indices.tolist() == [0, 1]


@pytest.mark.parametrize("strategy", [TIMESTAMP, STEP, CUSTOMIZED, LFU, NO_EVICTION, TIMESTAMP_LFU])
def test_grow_preserves_entries_and_scores(strategy, device):
    p = Pair(strategy, [1, 2, 1], device=device)
    keys = list(range(-30, 30)) + [INT64_MIN, INT64_MAX]
    for t in range(3):
        p.insert(keys, t, scores=list(range(len(keys))) if strategy in (CUSTOMIZED, LFU) else None,
                 now=t, step=t)
    p.erase(keys[::5], [1] * len(keys[::5]))  # tombstones are not carried over
    counters = p.table.get_counters()
    p.grow([2, 4, 1])
    p.grow([2, 12, 1], table_id=1)
    p.grow([6, 12, 4])
    assert p.table.get_counters() == counters
    # The grown table keeps working, with all rules.
    p.insert(keys, 1, scores=[5] * len(keys) if strategy in (CUSTOMIZED, LFU) else None, now=9, step=9)
    p.export()


def test_grow_is_refused_for_bad_capacities():
    t = ScoredHashTable([32, 64], 16, S.STEP, num_tables=2)
    t.insert(torch.arange(40), torch.tensor([0, 1] * 20))
    state = [x.clone() for x in (t.slot_keys, t.slot_digests, t.slot_scores)]
    with pytest.raises(ValueError, match="new capacity 48 must be a multiple of the current capacity 32"):
        t.grow(48, table_id=0)
    with pytest.raises(ValueError, match="new capacity 32 must be a multiple of the current capacity 64"):
        t.grow(32)
    with pytest.raises(ValueError, match="capacity 72 must be a positive multiple of bucket_capacity"):
        t.grow([64, 72])
    assert all(torch.equal(a, b) for a, b in zip(state, (t.slot_keys, t.slot_digests, t.slot_scores)))
    assert t.capacities() == [32, 64]
    with pytest.raises(RuntimeError, match=r"table 0: the new bucket count \(3\) must be a multiple of the old one \(2\)"):
        ops.table_rehash(table_arg(t), torch.tensor([0, 3, 7]), 16)


@pytest.mark.parametrize("strategy", [TIMESTAMP, LFU, TIMESTAMP_LFU])
def test_extreme_keys_are_ordinary_keys(strategy, device):
    extremes = [-1, 0, INT64_MIN, INT64_MAX]
    p = Pair(strategy, [2, 1], device=device)
    # Fresh slots hold key 0 with digest "empty": key 0 must not be found.
    assert p.lookup(extremes, [0] * 4)[1].tolist() == [False] * 4
    out = p.insert(extremes, 1, now=3)
    assert _results(out) == [R.INSERTED] * 4
    assert p.lookup(extremes, 1)[0].tolist() == out.indices.tolist()
    assert not p.lookup(extremes, 0)[1].any()  # the other table is separate
    assert sorted(k for k, *_ in p.export()) == sorted(extremes)
    assert p.erase([0, INT64_MIN], 1) == [True, True]
    assert p.lookup(extremes, 1)[1].tolist() == [True, False, False, True]
    assert _results(p.insert([INT64_MIN, 0, INT64_MAX], 1, now=4)) == [R.INSERTED, R.INSERTED, R.ASSIGNED]
    p.grow([2, 4])
    assert p.lookup(extremes, 1)[1].all()
