"""ScoredHashTable.lookup_gather (the fused table_lookup_gather op): the same
indices as the reference model's lookup, and each key's row of the values
tensor (zeros where missing), for every supported dtype; clear errors."""
import random

import pytest
import torch

from dynamicemb import DynamicEmbScoreStrategy as S
from dynamicemb import ScoredHashTable
from dynamicemb._ops import ops, table_arg
from reference import STEP
from table_harness import Pair

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _filled_pair(seed: int) -> Pair:
    """Two tables (3 and 20 buckets of 16), full enough to evict, with tombstones."""
    rng = random.Random(seed)
    p = Pair(STEP, [3, 20])
    keys = rng.sample(range(-5000, 5000), 500)
    tids = [rng.randrange(2) for _ in keys]
    p.insert(keys, tids, step=1)
    p.erase(keys[:60], tids[:60])
    return p


def _queries(p: Pair, n: int, seed: int):
    """n (key, table id) pairs: stored keys, missing keys, a key under the
    wrong table, repeats."""
    rng = random.Random(seed)
    live = sorted(p.live())
    pairs = [rng.choice(live) if rng.random() < 0.6 else (rng.randrange(2), rng.randrange(-6000, 6000))
             for _ in range(n)]
    keys, tids = [k for _, k in pairs], [t for t, _ in pairs]
    return keys, tids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,dim", [(0, 8), (37, 1), (300, 7), (5000, 64)])
def test_lookup_gather_matches_model(dtype, n, dim, threads):
    p = _filled_pair(n + dim)
    keys, tids = _queries(p, n, dim)
    values = torch.randn(p.table.capacity(), dim).to(dtype)
    rows, idx, found = p.table.lookup_gather(torch.tensor(keys, dtype=torch.int64), values,
                                             torch.tensor(tids, dtype=torch.int64))
    want_idx, want_found = p.model.lookup(keys, tids)
    assert idx.tolist() == want_idx and found.tolist() == want_found
    assert rows.dtype == dtype and rows.shape == (n, dim)
    want = torch.zeros(n, dim, dtype=dtype)
    hit = [i for i, f in enumerate(want_found) if f]
    want[hit] = values[[want_idx[i] for i in hit]]
    assert torch.equal(rows, want)
    # The unfused pair agrees.
    idx2, found2 = p.table.lookup(torch.tensor(keys, dtype=torch.int64), torch.tensor(tids, dtype=torch.int64))
    assert torch.equal(idx, idx2) and torch.equal(found, found2)
    assert torch.equal(rows[found], torch.index_select(values, 0, idx2[found2]))


def test_lookup_gather_into_out_and_single_table():
    t = ScoredHashTable(64, 16, S.STEP)
    keys = torch.arange(10, 30)
    t.insert(keys)
    values = torch.arange(64 * 3, dtype=torch.float32).view(64, 3)
    out = torch.full((22, 3), 7.0)
    q = torch.cat([keys, torch.tensor([-1, 1000])])
    rows, idx, found = t.lookup_gather(q, values, out=out)
    assert rows is out
    assert found.tolist() == [True] * 20 + [False] * 2
    assert torch.equal(out[:20], values[idx[:20]]) and not out[20:].any()
    # Nothing refreshed: a read-only lookup.
    assert torch.equal(t.slot_scores[idx[:20]], torch.zeros(20, dtype=torch.int64))


# ---- bad inputs ---------------------------------------------------------------------


@pytest.fixture
def t():
    t = ScoredHashTable([32, 16], 16, S.STEP, num_tables=2)
    t.insert(torch.arange(8), 0)
    return t


def test_bad_values(t):
    keys, tid = torch.arange(4), 0
    with pytest.raises(RuntimeError, match="values must be float32, float16 or bfloat16, got Long"):
        t.lookup_gather(keys, torch.zeros(48, 4, dtype=torch.int64), tid)
    with pytest.raises(RuntimeError, match=r"values must be 2-D with one row per slot \(48\), got shape \[32, 4\]"):
        t.lookup_gather(keys, torch.zeros(32, 4), tid)
    with pytest.raises(ValueError, match="values must be a 2-D tensor"):
        t.lookup_gather(keys, torch.zeros(48), tid)
    with pytest.raises(RuntimeError, match="values must be contiguous"):
        t.lookup_gather(keys, torch.zeros(4, 48).t(), tid)


def test_bad_out(t):
    keys, tid, values = torch.arange(4), 0, torch.zeros(48, 4)
    with pytest.raises(RuntimeError, match=r"out must have shape \[4, 4\] \(keys x dim\), got \[4, 5\]"):
        t.lookup_gather(keys, values, tid, out=torch.zeros(4, 5))
    with pytest.raises(RuntimeError, match=r"out must have shape \[4, 4\] \(keys x dim\), got \[3, 4\]"):
        t.lookup_gather(keys, values, tid, out=torch.zeros(3, 4))
    with pytest.raises(RuntimeError, match="out must be Float, got Half"):
        t.lookup_gather(keys, values, tid, out=torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="unsupported operation"):  # out overlaps values
        t.lookup_gather(keys, values, tid, out=values[:4])


def test_bad_keys_and_table_ids(t):
    values = torch.zeros(48, 4)
    with pytest.raises(ValueError, match="table_ids are required"):
        t.lookup_gather(torch.arange(4), values)
    with pytest.raises(RuntimeError, match=r"table id 2 \(key position 1\) is out of range \[0, 2\)"):
        t.lookup_gather(torch.arange(3), values, torch.tensor([0, 2, 1]))
    with pytest.raises(RuntimeError, match="keys must be Long, got Int"):
        ops.table_lookup_gather(table_arg(t), torch.arange(3, dtype=torch.int32), None, 16, values, torch.zeros(3, 4))
