"""The hot-row cache of a mapped InferenceEmbeddingTable (load(...,
hbm_cache_bytes=N)) and emb_lookup_forward's hot_weights / hot_pos: a table
served with any cache answers exactly as the in-memory table it was saved
from (every cache size from none to all rows, float32 and int8 rows, SUM /
MEAN / NONE, missing keys, the exported program); the op reads a cached row
from the cache (checked with cached rows that differ from the table's,
against the op over a table holding those rows); opchecked by the generated
twins."""
import sys

import pytest
import torch

from dynamicemb._ops import ops
from dynamicemb.inference import InferenceEmbeddingTable
from dynamicemb.inference.export import export
from frozen_tables import random_tables, tbe_batch
from op_checks import generate_opcheck_tests, opcheck_every_call


def _tables(dim_b=8, seed=0):
    return random_tables(seed, a_keys=600, b_keys=300, dim_b=dim_b)


_batch = tbe_batch



def _row_bytes(m):
    return sum(int(n) * w.shape[1] * w.element_size() for n, w in zip(m.num_keys().values(), m.weights()))


def _cached(m):
    return sum(int(p.ge(0).sum()) for p in m.hot_rows()[1]) if m.hot_cache else 0


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("pooling,weighted", [("SUM", True), (["MEAN", "SUM"], False), ("NONE", False)])
def test_cache_answers_as_the_table(tmp_path, dtype, pooling, weighted):
    tables = _tables(16 if pooling == "NONE" else 8)
    m = InferenceEmbeddingTable(tables, pooling=pooling, dtype=dtype, is_weighted=weighted, seed=7,
                                feature_order=["fc", "fa", "fb"])
    path = m.save(str(tmp_path / "t.safetensors"))
    total = _row_bytes(m)
    batches = [_batch(tables, 3, 5, 3, s, weighted) for s in range(2)]
    for budget in (0, 1000, total // 3, total, 10 * total):
        served = InferenceEmbeddingTable.load(path, hbm_cache_bytes=budget)
        cached = _cached(served)
        assert cached * min(w.shape[1] * w.element_size() for w in m.weights()) <= max(budget, 0)
        assert (cached == sum(m.num_keys().values())) == (budget >= total) and (cached > 0) == (budget >= 1000)
        for batch in batches:
            assert torch.equal(served(*batch), m(*batch)), budget
    # Its exported program reads the cache too; save() writes no cache.
    program = export(served).module()
    assert torch.equal(program(*batches[0]), m(*batches[0]))
    again = InferenceEmbeddingTable.load(served.save(str(tmp_path / "u.safetensors")))
    assert not again.hot_cache and torch.equal(again(*batches[1]), m(*batches[1]))


def test_hot_keys_pick_the_rows(tmp_path):
    tables = _tables()
    m = InferenceEmbeddingTable(tables)
    path = m.save(str(tmp_path / "t.safetensors"))
    hot = tables[1].keys[torch.randperm(300, generator=torch.Generator().manual_seed(1))[:40]]
    row = 8 * 4
    served = InferenceEmbeddingTable.load(path, hbm_cache_bytes=10 * row,
                                     hot_keys={"a": hot[:0], "b": torch.cat([hot, hot])})
    pos = served.hot_rows()[1]
    assert pos[0].numel() == 0 and int(pos[1].ge(0).sum()) == 10  # table a: no keys given, nothing cached
    # The first 10 given keys are cached, in their order.
    batch = (hot[:10], torch.tensor([0, 0, 0, 10]))
    assert torch.equal(served(*batch), m(*batch))
    cap, tb = m.bucket_capacity, m.table_buckets.tolist()
    keys_b = served.slot_keys[tb[1] * cap:tb[2] * cap]
    for h, k in enumerate(hot[:10].tolist()):
        assert int(pos[1][int((keys_b == k).nonzero())]) == h
    with pytest.raises(ValueError, match=r"hot_keys names tables \['c'\]"):
        InferenceEmbeddingTable.load(path, hbm_cache_bytes=64, hot_keys={"c": hot})
    with pytest.raises(ValueError, match="hbm_cache_bytes must be >= 0"):
        InferenceEmbeddingTable.load(path, hbm_cache_bytes=-1)


def _op_args(m, values, offsets, psw):
    return ([m.slot_keys], [m.slot_digests], [m.table_buckets], [m.bucket_capacity], [0] * len(m.dims),
            list(range(len(m.dims))), m.weights(), values, offsets, m.feature_table_map, m.dims, psw, m.pooling,
            m.eval_init_params, m.seed, m.output_dtype)


@opcheck_every_call
@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("pooling", ["SUM", "NONE"])
def test_op_reads_the_hot_rows(dtype, pooling):
    """Hot rows that differ from the table's (doubled codes / values): the op
    answers as over a table holding them at those rows."""
    tables = _tables(16 if pooling == "NONE" else 8)
    m = InferenceEmbeddingTable(tables, pooling=pooling, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    values, offsets, psw = _batch(tables, 3, 4, 3, 5, True)
    psw = None if pooling == "NONE" else psw
    hot_w, hot_pos, patched = [], [], []
    for t, w in enumerate(m.weights()):
        rows = torch.randperm(w.shape[0], generator=g)[:w.shape[0] // 2 if t == 0 else 0]
        new = w[rows].clone()
        if dtype == "int8":
            new[:, :4] = new[:, :4] // 2 + 1  # other codes, same scale and bias
        else:
            new = new * 2 + 1
        pos = torch.full((w.shape[0],), -1, dtype=torch.int32)
        pos[rows] = torch.arange(rows.numel(), dtype=torch.int32)
        hot_w.append(new if rows.numel() else w[:0].clone())
        hot_pos.append(pos if rows.numel() else pos[:0])
        p = w.clone()
        p[rows] = new
        patched.append(p)
    args = _op_args(m, values, offsets, psw)
    got = ops.emb_lookup_forward(*args, hot_w, hot_pos)
    want = ops.emb_lookup_forward(*args[:6], patched, *args[7:])
    assert torch.equal(got, want) and not torch.equal(got, ops.emb_lookup_forward(*args))


def test_op_rejects_bad_hot_rows():
    m = InferenceEmbeddingTable(_tables())
    args = _op_args(m, torch.arange(3), torch.tensor([0, 1, 2, 3]), None)
    w = m.weights()
    good_w, good_p = [x[:2].clone() for x in w], [torch.full((x.shape[0],), -1, dtype=torch.int32) for x in w]
    with pytest.raises(RuntimeError, match="given together"):
        ops.emb_lookup_forward(*args, good_w, None)
    with pytest.raises(RuntimeError, match="one entry per table"):
        ops.emb_lookup_forward(*args, good_w[:1], good_p[:1])
    with pytest.raises(RuntimeError, match="hot_pos of table 1 must be a contiguous int32"):
        ops.emb_lookup_forward(*args, good_w, [good_p[0], good_p[1][1:]])
    with pytest.raises(RuntimeError, match="hot_weights of table 0 must be"):
        ops.emb_lookup_forward(*args, [good_w[0].double(), good_w[1]], good_p)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_cuda_cache(tmp_path, dtype):
    """On CUDA: the cache in device memory, the other rows read from the
    registered host mapping; the same answers as the table held in device memory."""
    tables = _tables()
    m = InferenceEmbeddingTable(tables, pooling=["MEAN", "SUM"], dtype=dtype, device="cuda")
    path = m.save(str(tmp_path / "t.safetensors"))
    total = _row_bytes(m)
    for budget in (total // 3, total):
        served = InferenceEmbeddingTable.load(path, device="cuda", hbm_cache_bytes=budget)
        assert all(x.is_cuda for x in served.hot_rows()[0] + served.hot_rows()[1])
        for s in range(3):
            batch = tuple(x.cuda() for x in _batch(tables, 3, 5, 3, s, False))
            assert torch.equal(served(*batch), m(*batch))


generate_opcheck_tests(sys.modules[__name__])
