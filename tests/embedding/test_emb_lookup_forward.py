"""The fused eval forward (emb_lookup_forward: lookup + gather + pool in one
pass, no dedup) against the unfused path it replaces (emb_unique ->
storage.find -> emb_forward with the eval initial values): bit-identical,
over several tables and hash-table groups, mixed dims, every pooling,
per-sample weights, half/bfloat16 storage, missing keys; opchecked by the
generated twin of every test (tests/op_checks.py)."""
import sys

import pytest
import torch

from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
)
from dynamicemb._ops import ops
from emb_helpers import random_batch
from op_checks import generate_opcheck_tests, opcheck_every_call

P = DynamicEmbPoolingMode


def _unfused(m, indices, offsets, psw):
    """The eval forward without the fused op: dedup, find, gather."""
    ukeys, utids, inverse, _ = ops.emb_unique(indices, offsets, m.feature_table_map, m.num_tables)
    rows = m.storage.find(ukeys, utids)
    return ops.emb_forward(m.storage.weights(), rows, ukeys, inverse, offsets, m.feature_table_map, m.dims, psw,
                           m.pooling, m.storage.eval_init_params, m.seed, m.output_dtype)


def _module(dims, pooling, dtype=torch.float32, strategies=None, buckets=None, output_dtype=torch.float32,
            feature_table_map=None):
    opts = []
    for t, d in enumerate(dims):
        opts.append(DynamicEmbTableOptions(
            dim=d, max_capacity=256, bucket_capacity=(buckets or [16] * len(dims))[t], embedding_dtype=dtype,
            score_strategy=(strategies or [DynamicEmbScoreStrategy.TIMESTAMP] * len(dims))[t],
            eval_initializer_args=DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.UNIFORM, lower=-1.0,
                                                            upper=1.0)))
    return BatchedDynamicEmbeddingTables(opts, feature_table_map=feature_table_map, pooling_mode=pooling,
                                         output_dtype=output_dtype, seed=7)


def _train_then_compare(m, gen, psw_too, num_keys=400, batch=6, max_len=5):
    ftm = m.feature_table_map
    for _ in range(3):  # store some keys (about half of the key range)
        idx, off = random_batch(gen, ftm, [num_keys // 2] * m.num_tables, batch, max_len)
        m(idx, off).sum().backward()
    m.eval()
    for _ in range(3):  # keys in [0, num_keys): about half missing
        idx, off = random_batch(gen, ftm, [num_keys] * m.num_tables, batch, max_len)
        psw = torch.rand(idx.numel(), generator=gen) if psw_too else None
        with torch.no_grad():
            got = m(idx, off, psw)
        want = _unfused(m, idx, off, psw)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


@pytest.mark.parametrize("pooling", [P.SUM, P.MEAN], ids=lambda p: p.name)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_several_tables_mixed_dims(pooling, weighted):
    m = _module([8, 4, 16], pooling, feature_table_map=[0, 1, 2, 1])
    _train_then_compare(m, torch.Generator().manual_seed(1), weighted)


def test_pooling_none():
    m = _module([8, 8], P.NONE, feature_table_map=[1, 0, 1])
    _train_then_compare(m, torch.Generator().manual_seed(2), False)


@pytest.mark.parametrize("pooling", [P.SUM, P.NONE], ids=lambda p: p.name)
def test_several_hash_table_groups(pooling):
    """Tables grouped into three physical hash tables (by score strategy and
    bucket capacity), with the feature order crossing groups."""
    S = DynamicEmbScoreStrategy
    m = _module([4, 4, 4, 4], pooling, strategies=[S.TIMESTAMP, S.LFU, S.TIMESTAMP, S.LFU],
                buckets=[16, 16, 32, 16], feature_table_map=[3, 0, 2, 1, 0])
    assert len(m.storage.groups) == 3
    _train_then_compare(m, torch.Generator().manual_seed(3), False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("output_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_half_storage(dtype, output_dtype):
    m = _module([8, 12], P.MEAN, dtype=dtype, output_dtype=output_dtype)
    _train_then_compare(m, torch.Generator().manual_seed(4), True)


def test_large_batch_spans_and_threads():
    """More indices than one gather span, bucket capacity above 64 slots."""
    m = _module([16], P.SUM, buckets=[128], feature_table_map=[0, 0])
    _train_then_compare(m, torch.Generator().manual_seed(5), False, num_keys=300, batch=600, max_len=8)


def test_all_missing_and_empty_bags():
    m = _module([4, 4], P.SUM)
    m.eval()
    idx = torch.tensor([5, -1, 2**63 - 1, -(2**63)], dtype=torch.int64)
    off = torch.tensor([0, 0, 2, 2, 4])  # 2 features x 2 bags, two empty
    with torch.no_grad():
        got = m(idx, off)
    assert torch.equal(got, _unfused(m, idx, off, None))
    assert torch.equal(got[0, :4], torch.zeros(4))
    empty = torch.zeros(0, dtype=torch.int64)
    with torch.no_grad():
        out = m(empty, torch.zeros(5, dtype=torch.int64))
    assert torch.equal(out, torch.zeros(2, 8))


def test_nothing_inserted_scores_unchanged():
    m = _module([4], P.SUM)
    m(torch.arange(10), torch.tensor([0, 10])).sum().backward()
    ht = m.storage.groups[0][0]
    before = (ht.slot_keys.clone(), ht.slot_digests.clone(), ht.slot_scores.clone(), ht.size(0))
    m.eval()
    with torch.no_grad():
        m(torch.arange(20), torch.tensor([0, 20]))
    assert torch.equal(ht.slot_keys, before[0]) and torch.equal(ht.slot_digests, before[1])
    assert torch.equal(ht.slot_scores, before[2]) and ht.size(0) == before[3]


def _op_args(m, idx, off, psw, dtype):
    st = m.storage
    hts = [ht for ht, _ in st.groups]
    return ([h.slot_keys for h in hts], [h.slot_digests for h in hts], [h.table_buckets for h in hts],
            [h.bucket_capacity for h in hts], st._table_group, st._table_local, st.weights(), idx, off,
            m.feature_table_map, m.dims, psw, m.pooling, st.eval_init_params, m.seed, dtype)


@opcheck_every_call
@pytest.mark.parametrize("pooling", list(P), ids=lambda p: p.name)
def test_op_samples(pooling):
    """The op after a training step, per output dtype (its twin opchecks them)."""
    S = DynamicEmbScoreStrategy
    m = _module([4, 4], pooling, strategies=[S.TIMESTAMP, S.LFU], feature_table_map=[0, 1])
    gen = torch.Generator().manual_seed(6)
    idx, off = random_batch(gen, m.feature_table_map, [50, 50], 3, 4, min_len=1)
    m(idx, off).sum().backward()
    idx, off = random_batch(gen, m.feature_table_map, [100, 100], 3, 4, min_len=1)
    psw = None if pooling == P.NONE else torch.rand(idx.numel(), generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        ops.emb_lookup_forward(*_op_args(m, idx, off, psw, dtype))


def test_rejects_mismatched_placement():
    m = _module([4], P.SUM)
    idx, off = torch.arange(3), torch.tensor([0, 3])
    args = list(_op_args(m, idx, off, None, torch.float32))
    args[5] = [1]  # logical table 1 of a hash table holding one
    with pytest.raises(RuntimeError, match="logical table"):
        ops.emb_lookup_forward(*args)
    args[5] = [0]
    args[6] = [torch.zeros(8, 4)]  # rows do not match the slots
    with pytest.raises(RuntimeError, match="rows for"):
        ops.emb_lookup_forward(*args)


generate_opcheck_tests(sys.modules[__name__])
