"""dynamicemb.rules' score strategies and table counters against the spec
model (reference.py, written from the API doc) and against what the table
kernels do; the public strategy enum against the registry."""
import pytest
import torch

import reference
from dynamicemb import DynamicEmbScoreStrategy, InsertResult, ScoredHashTable, rules
from dynamicemb.types import strategy_code, strategy_of
from reference import RefTable

ALL = [pytest.param(s, id=s.name) for s in rules.STRATEGIES.values()]
NOW, STEP = 1000, 7  # the spec model's clock and step


def test_codes_are_the_specs_and_the_public_enums():
    assert {s.name: s.code for s in rules.STRATEGIES.values()} == \
        {s.name: getattr(reference, s.name) for s in rules.STRATEGIES.values()}
    public = {m.name: int(m) for m in DynamicEmbScoreStrategy}
    assert public == {s.name: s.code for s in rules.STRATEGIES.values() if s.code != rules.TIMESTAMP_LFU}
    assert strategy_code((DynamicEmbScoreStrategy.TIMESTAMP, DynamicEmbScoreStrategy.LFU)) == rules.TIMESTAMP_LFU
    assert all(strategy_code(strategy_of(code)) == code for code in rules.STRATEGIES)


def _spec_score(code, scores=None):
    """The score the spec model gives a new key (scores: the API argument)."""
    ref = RefTable([1], 16, code)
    idx, _, _ = ref.insert([3], scores=scores, now=NOW, step=STEP)
    return ref.scores[idx[0]]


@pytest.mark.parametrize("s", ALL)
def test_call_score_traits_are_the_specs(s):
    try:
        score = _spec_score(s.code)
    except TypeError:  # the spec needs the caller's scores
        score = None
    assert rules.scored_by_caller(s.code) == (score is None)
    assert rules.scored_by_step(s.code) == (score == STEP)
    assert rules.score_is_clock(s.code) == (score == NOW)
    assert rules.counts_accesses(s.code) == (score == 1)
    # An incremental dump's threshold is a clock reading for the keys' access times.
    ref = RefTable([1], 16, s.code)
    ref.insert([3], scores=5, now=NOW, step=STEP)
    ref.lookup_refresh([3], scores=5, now=2 * NOW, step=STEP)
    assert rules.access_time_is_clock(s.code) == bool(ref.export(threshold=NOW + 1))


@pytest.mark.parametrize("s", ALL)
def test_may_evict_is_the_specs(s):
    ref = RefTable([1], 16, s.code)
    ref.insert(list(range(100, 116)), scores=1, now=NOW, step=STEP)
    _, res, _ = ref.insert([999], scores=1, now=NOW, step=STEP)
    assert rules.may_evict(s.code) == (res == [reference.EVICTED])


def _table(s, device):
    return ScoredHashTable(16, bucket_capacity=16, score_strategy=strategy_of(s.code), device=device)


@pytest.mark.parametrize("s", ALL)
def test_traits_are_what_the_kernels_do(s, device):
    t = _table(s, device)
    t.slot_timestamps = torch.full((16,), -1, dtype=torch.int64, device=device)  # room for any strategy
    before = t.now()
    out = t.insert(torch.tensor([3], device=device), scores=1)
    after = t.now()
    slot = int(out.indices[0])
    score = int(t.slot_scores[slot])
    assert rules.score_is_clock(s.code) == (before <= score <= after)
    assert rules.keeps_timestamps(s.code) == (before <= int(t.slot_timestamps[slot]) <= after)
    for _ in range(2):
        t.lookup(torch.tensor([3], device=device), update_score=True, scores=1)
    assert rules.counts_accesses(s.code) == (int(t.slot_scores[slot]) == 3)
    # A full bucket: the next key evicts, or fails.
    t.insert(torch.arange(100, 115, device=device), scores=1)
    res = t.insert(torch.tensor([999], device=device), scores=1).results.tolist()
    assert res == [InsertResult.EVICTED if rules.may_evict(s.code) else InsertResult.FAILED]


@pytest.mark.parametrize("s", ALL)
def test_table_counter_columns_tally_the_results(s, device):
    t = _table(s, device)
    results = []
    for keys in (range(100, 116), range(116, 120), range(100, 104)):  # fill, then evict or fail, then find
        results += t.insert(torch.tensor(list(keys), device=device), scores=1).results.tolist()
    n = {r: results.count(int(r)) for r in InsertResult}
    c = t.counters[0].tolist()
    assert c[rules.TableCounter.INSERTED] == n[InsertResult.INSERTED] + n[InsertResult.EVICTED]
    assert c[rules.TableCounter.EVICTED] == n[InsertResult.EVICTED]
    assert c[rules.TableCounter.FAILED] == n[InsertResult.FAILED]
    assert t.get_counters(0) == dict(zip(rules.TABLE_COUNTERS, c))
    assert n[InsertResult.EVICTED] + n[InsertResult.FAILED] > 0
