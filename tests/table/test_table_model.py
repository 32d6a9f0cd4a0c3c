"""Property tests: random operation sequences run on ScoredHashTable and on the
reference model (reference.py) must agree on everything observable."""
import random

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from table_harness import Pair
from reference import CUSTOMIZED, INT64_MAX, INT64_MIN, LFU, NO_EVICTION, STEP, TIMESTAMP, TIMESTAMP_LFU

ALL_STRATEGIES = [TIMESTAMP, STEP, CUSTOMIZED, LFU, NO_EVICTION, TIMESTAMP_LFU]

# Deterministic and bounded: the whole tests/table run stays well under a minute.
PROPERTY = settings(
    derandomize=True,
    database=None,
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# A small key range over a few 16-slot buckets: buckets fill, evict and fail.
# The extreme keys are ordinary keys.
KEYS = st.one_of(st.integers(-8, 60), st.sampled_from([INT64_MIN, INT64_MAX, -1, 0]))
SMALL = st.integers(0, 6)  # scores / clocks / steps: small, so ties happen


def _scores(data, strategy, n):
    """The `scores` argument a call gives, per strategy."""
    if strategy == CUSTOMIZED:
        return data.draw(st.one_of(SMALL, st.lists(SMALL, min_size=n, max_size=n)))
    if strategy in (LFU, TIMESTAMP_LFU):
        return data.draw(st.one_of(st.none(), SMALL, st.lists(st.integers(-1, 4), min_size=n, max_size=n)))
    if strategy == STEP:
        return data.draw(st.one_of(st.none(), SMALL))
    return None  # TIMESTAMP / NO_EVICTION read the clock only


def _table_ids(data, num_tables, n):
    if num_tables == 1:
        return data.draw(st.sampled_from([None, 0, [0] * n]))
    return data.draw(st.one_of(st.integers(0, num_tables - 1),
                               st.lists(st.integers(0, num_tables - 1), min_size=n, max_size=n)))


@pytest.mark.parametrize("strategy", [TIMESTAMP, LFU])
@PROPERTY
@given(data=st.data())
def test_inserts_that_do_not_list_their_evictions_match_model(strategy, device, data):
    # list_evicted=False (the training step's inserts): the same slots,
    # results, counters and table as the model; only the evicted list is empty.
    counts = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=2), label="bucket counts")
    p = Pair(strategy, counts, 16, device)
    for _ in range(data.draw(st.integers(1, 12), label="inserts")):
        n = data.draw(st.integers(1, 40), label="n")
        keys = data.draw(st.lists(KEYS, min_size=n, max_size=n), label="keys")
        tids = _table_ids(data, len(counts), n)
        step = data.draw(SMALL)
        evict = data.draw(st.one_of(st.just(True), st.lists(st.booleans(), min_size=len(counts),
                                                              max_size=len(counts))), label="evict")
        res = p.insert(keys, tids, _scores(data, strategy, n), now=step, step=step, evict=evict,
                       list_evicted=data.draw(st.booleans(), label="list_evicted"),
                       hold_stored=data.draw(st.booleans(), label="hold_stored")).results.tolist()
        for r in set(res):
            event(f"insert result {r}")
        p.check_state()


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@PROPERTY
@given(data=st.data())
def test_random_operations_match_model(strategy, device, data):
    counts = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3), label="bucket counts")
    # 80: five groups of digests, the last past the first 64-byte line.
    cap = data.draw(st.sampled_from([16, 16, 32, 80]), label="bucket_capacity")
    p = Pair(strategy, counts, cap, device)
    for _ in range(data.draw(st.integers(1, 20), label="ops")):
        op = data.draw(st.sampled_from(
            ["insert"] * 4 + ["lookup", "refresh", "erase", "take", "export", "grow", "reset"]))
        if op in ("grow", "export", "reset"):
            if op == "grow" and sum(p.model.bucket_counts) <= 12:
                mult = data.draw(st.lists(st.integers(1, 3), min_size=len(counts), max_size=len(counts)))
                if len(counts) > 1 and data.draw(st.booleans()):  # one table, by table_id
                    t = data.draw(st.integers(0, len(counts) - 1))
                    p.grow([c * (mult[t] if i == t else 1) for i, c in enumerate(p.model.bucket_counts)],
                           table_id=t)
                else:
                    p.grow([c * k for c, k in zip(p.model.bucket_counts, mult)])
            elif op == "export":
                p.export(threshold=data.draw(st.one_of(st.none(), SMALL)),
                         batch_size=data.draw(st.sampled_from([7, 16, 1 << 16])),
                         table_id=data.draw(st.one_of(st.none(), st.integers(0, len(counts) - 1))))
            elif op == "reset":
                p.reset_counters()
            continue
        n = data.draw(st.integers(0, 64), label="batch size")  # uniform-ish: big batches too
        keys = data.draw(st.lists(KEYS, min_size=n, max_size=n))
        tids = _table_ids(data, len(counts), n)
        now, step = data.draw(SMALL), data.draw(SMALL)
        if op == "insert":
            # Per-table "may evict" flags and continuing the previous call, as the storage does
            # when it grows a table instead of evicting and retries its failed keys.
            evict = data.draw(st.one_of(st.just(True), st.lists(st.booleans(), min_size=len(counts),
                                                                  max_size=len(counts))), label="evict")
            same_call = data.draw(st.booleans(), label="same_call")
            hold = data.draw(st.booleans(), label="hold_stored")
            res = p.insert(keys, tids, _scores(data, strategy, n), now=now, step=step, evict=evict,
                           same_call=same_call, hold_stored=hold).results.tolist()
            for r in set(res):  # --hypothesis-show-statistics: evictions and failures do happen
                event(f"insert result {r}")
        elif op == "lookup":
            p.lookup(keys, tids)
        elif op == "refresh":
            p.lookup(keys, tids, update_score=True, scores=_scores(data, strategy, n), now=now, step=step)
        else:
            # Erase present keys too, so that tombstones get reused.
            live = sorted(p.live())
            pairs = data.draw(st.lists(st.sampled_from(live), max_size=12)) if live else []
            pairs += list(zip(p.model._tids(tids, n), keys))[: n // 2]
            et = [t for t, _ in pairs]
            et = et if len(counts) > 1 or data.draw(st.booleans()) else None
            if op == "erase":
                p.erase([k for _, k in pairs], et)
            else:  # erase returning what the keys held
                p.take([k for _, k in pairs], et, with_values=data.draw(st.booleans()))
    p.export()


def _batch(rng, n, key_range, num_tables):
    keys = [rng.randrange(key_range) - key_range // 4 for _ in range(n)]
    keys[rng.randrange(n)] = INT64_MIN
    return keys, [rng.randrange(num_tables) for _ in range(n)]


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_large_batches_match_model(strategy, threads, device):
    rng = random.Random(strategy)
    # 3 tables (2, 40 and 150 buckets): the small one fails and evicts a lot.
    p = Pair(strategy, [2, 40, 150], device=device)
    n, seen = 6000, set()
    for step in range(3):
        keys, tids = _batch(rng, n, 4000, 3)
        freq = [rng.randrange(1, 4) for _ in range(n)]
        scores = {CUSTOMIZED: freq, LFU: freq, TIMESTAMP_LFU: None, STEP: step}.get(strategy)
        seen |= set(p.insert(keys, tids, scores, now=step, step=step).results.tolist())
        keys2, tids2 = _batch(rng, n, 4000, 3)
        p.lookup(keys2, tids2)
        p.lookup(keys2, tids2, update_score=True, scores=freq if strategy in (CUSTOMIZED, LFU) else None,
                 now=step + 10, step=step + 10)
        (p.take if step % 2 else p.erase)(keys2[:4500], tids2[:4500])  # take: erase returning what left
    p.export(batch_size=1000)
    # Every outcome happened (a call cannot evict its own keys: the first fails).
    assert seen == ({0, 1, 3} if strategy == NO_EVICTION else {0, 1, 2, 3})


def test_very_large_batch_matches_model(threads, device):
    """n >= 32768: the per-table tallies and the evicted-key compaction split
    the batch in several chunks; the output order must still be input order."""
    rng = random.Random(7)
    p = Pair(LFU, [256, 64], device=device)
    keys, tids = _batch(rng, 40000, 9000, 2)
    p.insert(keys, tids, [rng.randrange(5) for _ in keys])
    keys, tids = _batch(rng, 40000, 9000, 2)
    p.insert(keys, tids, [rng.randrange(5) for _ in keys])
    p.erase(keys[:20000], tids[:20000])
    p.take(keys[20000:], tids[20000:])
    p.export()


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("cap,buckets", [(16, [300, 40]), (128, [2, 40])])
@pytest.mark.parametrize("hold", [False, True])
def test_many_keys_per_full_bucket_match_model(strategy, cap, buckets, hold, threads, device):
    """Full buckets that get many keys of one call (insert takes several
    victims from one scan of a bucket): assigns, tombstones reused, evictions
    with tied scores and failures once a bucket is all held, mixed in batches
    that take the parallel path."""
    rng = random.Random(1000 + strategy + cap)
    p = Pair(strategy, buckets, cap, device)
    slots = sum(buckets) * cap

    def scores(n, step):
        freq = [rng.randrange(0, 3) for _ in range(n)]  # small: many ties
        return {CUSTOMIZED: freq, LFU: freq, TIMESTAMP_LFU: freq, STEP: step}.get(strategy)

    def tids(n):
        return [rng.randrange(len(buckets)) for _ in range(n)]

    fresh = iter(rng.sample(range(-(1 << 40), 1 << 40), 4 * slots + 20000))
    # Overfill: every bucket ends full, most of them after evicting.
    keys = [next(fresh) for _ in range(max(4096, slots + slots // 3))]
    p.insert(keys, tids(len(keys)), scores(len(keys), 1), now=1, step=1)
    live = sorted(p.live())
    # Tombstones in full buckets, reused before any eviction.
    gone = rng.sample(live, len(live) // 10)
    p.erase([k for _, k in gone], [t for t, _ in gone])
    live = sorted(p.live())
    seen = set()
    for step in (2, 3):
        # Present keys (assign, and held: never evicted by later keys), new
        # keys, and repeats within the call.
        old = rng.sample(live, min(len(live), 1500))
        new_keys = [next(fresh) for _ in range(6000)]
        batch = [(t, k) for t, k in old] + list(zip(tids(len(new_keys)), new_keys))
        batch += rng.sample(batch, 300)
        rng.shuffle(batch)
        out = p.insert([k for _, k in batch], [t for t, _ in batch], scores(len(batch), step), now=step,
                       step=step, same_call=step == 3, hold_stored=hold)
        res = out.results.tolist()
        seen |= set(res)
        if strategy != NO_EVICTION:  # several victims taken from one bucket in one call
            per_bucket = torch.bincount(out.evicted.indices.cpu() // cap)
            assert int(per_bucket.max()) > 1
        live = sorted(p.live())
    p.lookup([k for _, k in live[:5000]], [t for t, _ in live[:5000]], update_score=True,
             scores=scores(min(5000, len(live)), 4), now=4, step=4)
    p.export()
    assert seen == ({0, 1, 3} if strategy == NO_EVICTION else {0, 1, 2, 3})


def test_export_and_grow_of_a_large_table_match_model(threads, device):
    """>= 32768 slots and > 256 buckets: export's compaction and grow's rehash
    split the table into several chunks that run in parallel; the result must
    still be the model's (slot order, every entry and score kept)."""
    rng = random.Random(11)
    p = Pair(LFU, [2100, 300], device=device)  # 38400 slots of 16
    keys, tids = _batch(rng, 30000, 1 << 40, 2)
    p.insert(keys, tids, [rng.randrange(1, 5) for _ in keys])
    p.erase(keys[:3000], tids[:3000])
    p.export(batch_size=1 << 16)
    p.export(threshold=3, batch_size=10000)
    p.grow([4200, 300])
    p.grow([8400, 600])
    p.export()


@pytest.mark.parametrize("cap", [16, 128])
def test_full_buckets_with_spread_and_rising_scores_match_model(cap, threads, device):
    """The victim lists of full buckets by both CPU paths (one filtered pass
    while scores rise with the slot, ranks under a threshold for scores in no
    slot order) and the switches between them within a walk. CUSTOMIZED
    scores: a table filled and evicted with rising scores (the oldest slots
    first), then scores over the whole int64 range (extremes included) with
    half the keys refreshed, then few distinct values. Runs take up to ~25
    victims of one bucket; repeats and present keys hold slots."""
    rng = random.Random(77 + cap)
    buckets = [2048 // cap, 2]
    p = Pair(CUSTOMIZED, buckets, cap, device)
    slots = sum(buckets) * cap
    fresh = iter(rng.sample(range(-(1 << 50), 1 << 50), 4 * slots))
    clock = iter(range(1 << 40, 1 << 41))

    def batch(n, old):
        tids = [rng.randrange(len(buckets)) for _ in range(n)]
        pairs = list(zip(tids, (next(fresh) for _ in range(n)))) + rng.sample(old, min(len(old), n // 8))
        pairs += rng.sample(pairs, n // 16)
        rng.shuffle(pairs)
        return [k for _, k in pairs], [t for t, _ in pairs]

    def spread(n):
        return [rng.choice([INT64_MIN, INT64_MAX]) if rng.random() < 0.02 else rng.randrange(INT64_MIN, INT64_MAX)
                for _ in range(n)]

    for _ in range(4):  # full in slot order
        keys, tids = batch(slots // 3, [])
        p.insert(keys, tids, [next(clock) for _ in keys])
    for phase in ("rising", "spread", "few values"):
        for n in (slots // 8, cap // 4, slots // 8):
            live = sorted(p.live())
            if phase == "spread":  # refresh a random half: scores in no slot order
                half = rng.sample(live, len(live) // 2)
                p.lookup([k for _, k in half], [t for t, _ in half], update_score=True, scores=spread(len(half)))
            keys, tids = batch(n, live)
            scores = {"rising": lambda: [next(clock) for _ in keys], "spread": lambda: spread(len(keys)),
                      "few values": lambda: [rng.randrange(3) for _ in keys]}[phase]()
            out = p.insert(keys, tids, scores)
            if n > cap // 4:  # several victims taken from one bucket in one call
                assert int(torch.bincount(out.evicted.indices.cpu() // cap).max()) > 1
    p.export()
