"""Prefetching one batch ahead of the forward (prefetch(i + 1) before
forward(i), as a loop that overlaps the next batch's prefetch with this
step does): the rows of batch i + 1 stay pinned through batch i's step, so
every key of a forward that was stored before is a cache hit (the only
misses are new keys), and training equals the all-in-memory table's."""
import pytest
import torch

import dynamicemb.batched_dynamicemb_tables as bdt
from tier_helpers import batches, make_store, module, step


@pytest.mark.parametrize("store_kind", ["host", "file"])
def test_prefetch_ahead_keeps_the_next_batch_cached(tmp_path, store_kind):
    ref = module()
    cached = module(store=make_store(store_kind, tmp_path), cache_rows=512)
    data = batches(40)
    cached.prefetch(*data[0])
    for i, b in enumerate(data):
        if i + 1 < len(data):
            cached.prefetch(*data[i + 1])
        assert torch.equal(step(cached, b), step(ref, b)), f"step {i}"
    for name, s in cached.table_stats().items():
        assert s["write_backs"] > 0 and s["store_rows"] > 0, f"{name}: {s}"  # the cache did evict
        assert s["misses"] == s["inserted"] == ref.table_stats()[name]["size"], f"{name}: {s}"


def test_forward_reuses_its_prefetch_dedup_only_for_the_same_batch(monkeypatch):
    """A prefetched batch's forward reuses the prefetch's deduplication
    (one emb_unique per step); a batch changed in place since its prefetch,
    or another batch, is deduplicated again: training equals the all-in-memory table's."""
    calls = []
    real_ops = bdt.ops

    class CountingOps:  # the module's ops, counting emb_unique calls
        def __getattr__(self, name):
            op = getattr(real_ops, name)
            return (lambda *a: calls.append(name) or op(*a)) if name == "emb_unique" else op

    monkeypatch.setattr(bdt, "ops", CountingOps())
    ref = module()
    cached = module(store=make_store("host"), cache_rows=512)
    data = batches(6)

    def forward_counts(batch, expect_calls):
        calls.clear()
        assert torch.equal(step(cached, batch), step(ref, batch))
        assert len(calls) == expect_calls + 1  # + the reference's own

    cached.prefetch(*data[0])
    cached.prefetch(*data[1])
    forward_counts(data[0], 0)  # the same tensors
    forward_counts((data[1][0].clone(), data[1][1].clone()), 0)  # equal tensors
    cached.prefetch(*data[2])
    data[2][0].add_(1)  # changed in place after its prefetch
    forward_counts(data[2], 1)
    cached.prefetch(*data[3])
    forward_counts(data[4], 1)  # not the prefetched batch
    forward_counts(data[3], 0)  # its prefetch is still kept
    forward_counts(data[3], 1)  # used once


def test_a_prefetch_in_eval_mode_moves_nothing():
    """A prefetch pipeline run under model.eval() prefetches each eval batch:
    that moved the cache's rows into a full store, which evicted trained rows.
    Eval reads both tiers and moves nothing, prefetched or not."""
    m = module(store=make_store("host"), cache_rows=128, max_capacity=1024)
    for b in batches(30):
        step(m, b)
    before = m.table_stats()
    assert all(s["evicted"] > 0 for s in before.values())  # the store is full
    m.eval()
    with torch.no_grad():
        for ids, offsets in batches(3, seed=9):
            m.prefetch(ids + 10**6, offsets)  # keys never seen
            m(ids + 10**6, offsets)
    assert m.table_stats() == before


@pytest.mark.parametrize("seed", [0, 2, 6])
def test_admission_with_prefetch_in_torchrec_order_equals_all_in_memory(seed):
    """TorchRec's prefetch pipeline runs forward(i), prefetch(i + 1),
    backward(i). With admission the forward stores only the admitted keys:
    it may reuse its prefetch's slots only for exactly the keys they were
    found for. (A count that matched by chance gave keys other keys' slots:
    wrong rows, keys of one table lost to the other, or a crash.) A small
    cache over a store that never evicts trains as the all-in-memory table."""
    import warnings

    from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbTableOptions, EmbOptimType,
                            FrequencyAdmissionStrategy, KVCounter)
    from dynamicemb.tiers import HostStore

    def build(cached):
        store = HostStore(bucket_capacity=16)

        def opt(threshold):
            adm = (dict(admit_strategy=FrequencyAdmissionStrategy(threshold), admission_counter=KVCounter(1 << 14))
                   if threshold else {})
            c = dict(caching=True, global_hbm_for_values=32 * 4 * 4, backing_store=store) if cached else {}
            return DynamicEmbTableOptions(dim=4, max_capacity=4096, bucket_capacity=16, **c, **adm)
        return BatchedDynamicEmbeddingTables([opt(2), opt(0)], table_names=["t0", "t1"],
                                             optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.5, seed=1)

    mem, cached = build(False), build(True)
    g = torch.Generator().manual_seed(seed)
    B, T = 8, 2
    data = []
    for _ in range(60):
        lengths = torch.randint(0, 4, (T * B,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        data.append(((torch.rand(int(lengths.sum()), generator=g) ** 2 * 300).long(), offsets))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*cannot hold one step")  # the cache is small on purpose
        for i, b in enumerate(data):
            grad = torch.randn(B, T * 4, generator=g)
            ym = mem(*b)
            (ym * grad).sum().backward()
            yc = cached(*b)
            if i + 1 < len(data):
                cached.prefetch(*data[i + 1])
            (yc * grad).sum().backward()
            assert torch.equal(ym, yc), f"step {i}"
    stats = cached.table_stats()
    assert all(s["evicted"] == 0 for s in stats.values()), stats  # the store never evicted
    for t in range(T):
        want = {k: v for b in mem.storage.export_rows(t) for k, v in zip(b.keys.tolist(), b.values)}
        got = {k: v for b in cached.storage.export_rows(t) for k, v in zip(b.keys.tolist(), b.values)}
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), f"table t{t}"
