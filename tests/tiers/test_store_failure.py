"""A backing store that raises taking the rows the cache evicted, mid-step:
the step raises naming the table and how many keys are lost; those are
counted as evicted, and every key left holds its own row (the all-in-memory
table's, trained on the steps before), with or without prefetch."""
import pytest
import torch

from tier_helpers import DictStore, all_rows, batches, module, step


class FailingPut(DictStore):
    armed = False

    def put(self, name, keys, rows, scores):
        if self.armed:
            self.armed = False
            raise ConnectionError("parameter server unreachable")
        return super().put(name, keys, rows, scores)


@pytest.mark.parametrize("fail_at", [20, 30])
@pytest.mark.parametrize("prefetch", [False, True])
def test_a_store_failing_a_write_back_loses_only_counted_keys(fail_at, prefetch):
    store = FailingPut()
    ref, cached = module(tables=1), module(store=store, tables=1)
    data = batches(fail_at + 1, tables=1)
    for b in data[:fail_at]:
        if prefetch:
            cached.prefetch(*b)
        assert torch.equal(step(cached, b), step(ref, b))
    before = cached.table_stats()["t0"]["evicted"]
    store.armed = True
    with pytest.raises(RuntimeError, match=r"backing store failed.*tables \['t0'\].*ConnectionError.*keys lost "
                                           r"\(counted as evicted in table_stats\): 't0': \d+") as info:
        if prefetch:
            cached.prefetch(*data[fail_at])
        step(cached, data[fail_at])
    assert not store.armed  # the put did raise
    want, got = all_rows(ref, 0), all_rows(cached, 0)
    assert got.keys() <= want.keys()  # none of the failed step's new keys stayed
    assert all(torch.equal(got[k], want[k]) for k in got)
    lost = len(want.keys() - got.keys())
    assert lost > 0 and f"'t0': {lost}" in str(info.value)
    s = cached.table_stats()["t0"]
    assert s["evicted"] - before == lost and s["size"] == len(got) == s["cache_rows"] + s["store_rows"]
