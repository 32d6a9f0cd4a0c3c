"""table_insert of a call whose keys are all stored already (a trained
table's usual step): the CPU kernel finds them with the lookup's pipeline and
commits them as accessed without regrouping by bucket. Compared with the
reference model (table_harness.Pair) for every strategy: keys given twice in
one call (in input order for LFU and CUSTOMIZED, whose accesses add or
overwrite per key), full buckets, batches large enough for the parallel
passes, and calls with one new key among many stored ones (the pass stops,
the general walk runs)."""
import random

import pytest
import torch

from reference import ASSIGNED, CUSTOMIZED, EVICTED, LFU, NO_EVICTION, STEP, TIMESTAMP, TIMESTAMP_LFU
from table_harness import Pair

ALL_STRATEGIES = [TIMESTAMP, STEP, CUSTOMIZED, LFU, NO_EVICTION, TIMESTAMP_LFU]


def _scores(strategy, rng, n, step):
    if strategy in (CUSTOMIZED, LFU):
        return [rng.randrange(1, 9) for _ in range(n)]
    return step if strategy == STEP else None


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_calls_of_stored_keys_match_model(strategy, threads, device):
    rng = random.Random(strategy)
    # 16-slot buckets, 2 tables; the small one fills its buckets.
    p = Pair(strategy, [8, 200], bucket_capacity=16, device=device)
    keys = [rng.randrange(-2**40, 2**40) for _ in range(2500)]
    tids = [0 if i < 100 else 1 for i in range(len(keys))]
    p.insert(keys, tids, _scores(strategy, rng, len(keys), 0), now=1, step=1)
    # The keys the first call stored (a failed one is not stored).
    out = p.table.lookup(torch.tensor(keys, device=device), torch.tensor(tids, device=device))
    ok = [i for i, f in enumerate(out[1].tolist()) if f]
    assert len(ok) > 2000
    for step in range(2, 6):
        pick = [ok[rng.randrange(len(ok))] for _ in range(6000)]  # many keys twice
        ks, ts = [keys[i] for i in pick], [tids[i] for i in pick]
        res = p.insert(ks, ts, _scores(strategy, rng, len(ks), step), now=step, step=step).results
        assert set(res.tolist()) == {ASSIGNED}  # all found
    # One new key among stored ones: the general walk, as before.
    ks = [keys[i] for i in ok[:3000]] + [2**50 + 1]
    ts = [tids[i] for i in ok[:3000]] + [1]
    res = p.insert(ks, ts, _scores(strategy, rng, len(ks), 9), now=9, step=9).results.tolist()
    assert res[-1] != ASSIGNED and set(res[:-1]) <= {ASSIGNED, EVICTED}
    p.export()


def test_a_bad_table_id_among_stored_keys_is_refused(device):
    p = Pair(LFU, [4, 4], device=device)
    p.insert([1, 2, 3], [0, 1, 0], [1, 1, 1])
    with pytest.raises(RuntimeError, match="table"):
        p.table.insert(torch.tensor([1, 2, 3], device=p.device), torch.tensor([0, 1, 7], device=p.device),
                       scores=torch.tensor([1, 1, 1], device=p.device))
