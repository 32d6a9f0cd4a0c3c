"""ScoredHashTable.refresh: an access of keys at slots found earlier scores
them as lookup(update_score=True) does (a Python model of each strategy's
rule), touches no other slot, skips -1, and rejects a slot out of range."""
import time

import pytest
import torch

from dynamicemb import DynamicEmbScoreStrategy as S
from dynamicemb import ScoredHashTable

_STRATEGIES = [S.TIMESTAMP, S.STEP, S.CUSTOMIZED, S.LFU, (S.TIMESTAMP, S.LFU)]


def _filled(strategy):
    t = ScoredHashTable([64, 64], 16, strategy, num_tables=2)
    keys, tids = torch.arange(100), torch.arange(100) % 2
    t.insert(keys, tids, scores=None if strategy in (S.TIMESTAMP, S.STEP) else torch.arange(100) + 5)
    return t, keys, tids


@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_refresh_scores_as_a_lookup_that_refreshes(strategy):
    t, keys, tids = _filled(strategy)
    slots, found = t.lookup(keys[10:40], tids[10:40])
    assert bool(found.all())
    slots = torch.cat([slots, torch.tensor([-1])])  # no key: skipped
    per_key = torch.arange(31) * 3 + 1
    given = 7 if strategy == S.STEP else (None if strategy == S.TIMESTAMP else per_key)
    before_scores, before_ts = t.slot_scores.clone(), t.slot_timestamps.clone()
    t0 = time.monotonic_ns()
    t.refresh(slots, given)
    t1 = time.monotonic_ns()
    s = slots[:-1]
    others = torch.ones(t.slot_scores.numel(), dtype=torch.bool)
    others[s] = False
    assert torch.equal(t.slot_scores[others], before_scores[others])
    got = t.slot_scores[s]
    if strategy == S.STEP:
        assert bool((got == 7).all())
    elif strategy == S.CUSTOMIZED:
        assert torch.equal(got, per_key[:-1])
    elif strategy in (S.LFU, (S.TIMESTAMP, S.LFU)):
        assert torch.equal(got, before_scores[s] + per_key[:-1])  # counts add up
    else:
        assert bool(((got >= t0) & (got <= t1)).all())
    if strategy == (S.TIMESTAMP, S.LFU):  # the access time too
        ts = t.slot_timestamps[s]
        assert bool(((ts >= t0) & (ts <= t1)).all())
        assert torch.equal(t.slot_timestamps[others], before_ts[others])
    # The same as lookup(update_score=True) on a twin table (clock strategies: by the rule above).
    if strategy in (S.STEP, S.CUSTOMIZED, S.LFU):
        twin, _, _ = _filled(strategy)
        twin.slot_scores.copy_(before_scores)
        twin.lookup(keys[10:40], tids[10:40], update_score=True, scores=given if strategy == S.STEP else per_key[:-1])
        assert torch.equal(twin.slot_scores, t.slot_scores)


def test_refresh_rejects_a_slot_out_of_range():
    t, _, _ = _filled(S.STEP)
    with pytest.raises(RuntimeError, match=r"slot index 128 \(position 1\) is out of range \[-1, 128\)"):
        t.refresh(torch.tensor([3, 128]), 5)
    with pytest.raises(TypeError, match="1-D int64"):
        t.refresh(torch.tensor([3.0]), 5)


def test_a_missing_keys_minus_one_is_no_slot_for_scores_of_and_hold():
    """-1 (lookup's "not found") read the last slot's score and held it (so a
    later same-call insert evicted another key): scores_of gives 0 there,
    and hold refuses it."""
    t = ScoredHashTable(16, 16, S.CUSTOMIZED)
    t.insert(torch.arange(16), scores=torch.arange(16) + 70)
    idx, found = t.lookup(torch.tensor([999, 3]))
    assert idx[0] == -1 and bool(found[1])
    assert t.scores_of(idx).tolist() == [0, 73]
    with pytest.raises(ValueError, match=r"hold: indices must be slots \(>= 0\)"):
        t.hold(idx)


def test_scores_thresholds_and_capacities_are_checked_by_name():
    """A STEP insert truncated 1.7 to step 1; grow(256.0) and a float export
    threshold failed inside the bindings."""
    step = ScoredHashTable(16, 16, S.STEP)
    with pytest.raises(ValueError, match="STEP insert: a score must be an int in int64's range, got 1.7"):
        step.insert(torch.arange(4), scores=1.7)
    with pytest.raises(TypeError, match=r"grow: capacities are ints \(slots\), got 256.0"):
        step.grow(256.0)
    with pytest.raises(TypeError, match=r"grow: with table_id, new_capacity is that table's \(one int\), got \[32"):
        step.grow([32, 64], table_id=0)
    with pytest.raises(ValueError, match="export: a score must be an int"):
        list(step.export(threshold=1.5))
    step.insert(torch.arange(4), scores=3)
    assert sorted(k for b in step.export(threshold=3) for k in b.keys.tolist()) == [0, 1, 2, 3]
    # Every strategy's int scores, and the table's own step, past int64: named (they failed in the bindings).
    step.step = 2**63
    with pytest.raises(ValueError, match=f"STEP insert: a score must be an int in int64's range, got {2**63}"):
        step.insert(torch.arange(2))
    for strategy, what in ((S.CUSTOMIZED, "CUSTOMIZED score"), (S.LFU, "scores")):
        t = ScoredHashTable(16, 16, strategy)
        with pytest.raises(ValueError, match=f"{what}: a score must be an int in int64's range, got {2**63}"):
            t.insert(torch.arange(2), scores=2**63)
        with pytest.raises(ValueError, match=f"{what}: a score must be an int in int64's range, got {-2**63 - 1}"):
            t.lookup(torch.arange(2), update_score=True, scores=-2**63 - 1)
        assert t.size() == 0
