"""Prefetching one batch ahead of the forward (prefetch(i + 1) before
forward(i), as a loop that overlaps the next batch's prefetch with this
step does): the rows of batch i + 1 stay pinned through batch i's step, so
every key of a forward that was stored before is a cache hit (the only
misses are new keys), and training equals the all-in-memory table's."""
import pytest
import torch

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
