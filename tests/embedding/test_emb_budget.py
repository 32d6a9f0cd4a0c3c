"""NO_EVICTION tables grow past max_capacity into their memory budget, and a
table at its budget (API.md §1 memory_budget) fails new keys: counted, a
WARNING that explains the budget once per table, DynamicEmbBudgetError under
ERROR; no stored row is lost, and growth past the budget is refused before
anything is allocated. The reference is a dict key -> row: DEBUG initial
value less lr times the key's occurrences (SGD, loss = sum of outputs)."""
import warnings
from collections import Counter

import pytest
import torch

from dynamicemb import (DynamicEmbBudgetError, DynamicEmbCheckMode, DynamicEmbPoolingMode, DynamicEmbScoreStrategy,
                        ScoredHashTable)
from dynamicemb.memory import table_bytes
from dynamicemb.storage_protocol import RowBatch
from emb_helpers import DEBUG_INIT, debug_rows, make_module, stored, stored_keys

D, LR = 4, 0.5
ROW_BYTES = D * 4  # float32 values, EXACT_SGD keeps no state
MAX_CAP = 32  # two 16-slot buckets


def _module(mode=DynamicEmbCheckMode.WARNING, budget=None, device="cpu"):
    return make_module([D], pooling=DynamicEmbPoolingMode.NONE, max_capacity=MAX_CAP, bucket_capacity=16,
                       score_strategy=DynamicEmbScoreStrategy.NO_EVICTION, initializer_args=DEBUG_INIT,
                       safe_check_mode=mode, memory_budget=budget,
                       module_kwargs=dict(learning_rate=LR, table_names=["keep"]), device=device)


def _batches(n_keys, steps, seed=3):
    """Random keys from [0, n_keys) with repeats, every key at least once over the steps."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n_keys, generator=gen)
    for part in perm.chunk(steps):
        extra = torch.randint(0, n_keys, (part.numel() // 2,), generator=gen)
        yield torch.cat([part, extra])


def _train(m, batches, device, reference, warned=None):
    """Trains on the batches; keeps the reference {key: row} of the keys that
    got a row (count of its occurrences in steps where it was stored)."""
    for ids in batches:
        before = stored_keys(m, 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = m(ids.to(device), torch.arange(ids.numel() + 1, device=device))
            m.table_stats()  # on CUDA a step's failures may warn after it: by table_stats
        if warned is not None:
            warned.extend(str(w.message) for w in caught)
        out.sum().backward()
        now = stored_keys(m, 0)
        assert before <= now, "a stored key was lost"
        for k, c in Counter(ids.tolist()).items():
            if k in now:
                reference[k] = reference.get(k, debug_rows([k], D)[0]) - LR * c


def _check_rows(m, reference):
    keys = sorted(reference)
    assert stored_keys(m, 0) == set(keys)
    found, rows = stored(m, 0, keys)
    assert bool(found.all())
    torch.testing.assert_close(rows[:, :D], torch.stack([reference[k] for k in keys]), atol=1e-5, rtol=0)


def test_no_eviction_grows_past_max_capacity_keeping_every_key(device):
    m = _module(budget=1 << 20, device=device)
    reference = {}
    _train(m, _batches(600, 5), device, reference)
    stats = m.table_stats()["keep"]
    assert stats["failed"] == 0 and stats["evicted"] == 0 and stats["size"] == 600 == len(reference)
    assert stats["capacity"] >= 1200 > MAX_CAP  # grew by its load factor, far past max_capacity
    _check_rows(m, reference)


def test_without_budget_a_module_table_stops_at_max_capacity(device):
    # Outside a planner the budget defaults to the table's bytes at max_capacity.
    m = _module(device=device)
    with pytest.warns(RuntimeWarning, match="could not be stored"):
        m(torch.arange(100, device=device), torch.arange(101, device=device))
        m.table_stats()  # on CUDA the warning may come after the step, by table_stats at the latest
    assert m.table_stats()["keep"]["capacity"] == MAX_CAP


def test_budget_reached_warns_once_counts_and_keeps_rows(device):
    budget = table_bytes(4 * MAX_CAP, ROW_BYTES)  # room for two doublings
    m = _module(budget=budget, device=device)
    reference, warned = {}, []
    _train(m, _batches(400, 4), device, reference, warned)
    stats = m.table_stats()["keep"]
    assert stats["capacity"] == 4 * MAX_CAP and stats["size"] == len(reference) <= 4 * MAX_CAP
    assert stats["failed"] > 0 and stats["evicted"] == 0
    # Every step with failures warned with its count; the budget is explained once, naming the table.
    assert len(warned) >= 2 and all("could not be stored" in w for w in warned)
    explained = [w for w in warned if "memory budget" in w and f"memory_budget of {budget} bytes" in w]
    assert len(explained) == 1 and "'keep'" in explained[0] and f"{4 * MAX_CAP} slots" in explained[0]
    _check_rows(m, reference)


def test_budget_reached_under_error_raises_the_named_error(device):
    budget = table_bytes(2 * MAX_CAP, ROW_BYTES)
    m = _module(DynamicEmbCheckMode.ERROR, budget=budget, device=device)
    reference = {}
    _train(m, [torch.arange(20)], device, reference)  # fits: no error
    with pytest.raises(DynamicEmbBudgetError, match=rf"table 'keep'.*memory_budget of {budget} bytes.*raise "
                                                    r"memory_budget"):
        m(torch.arange(200, device=device), torch.arange(201, device=device))
    stats = m.table_stats()["keep"]
    assert stats["failed"] > 0 and stats["size"] + stats["failed"] == 200
    assert set(reference) <= stored_keys(m, 0)  # what was stored stays, with its rows
    found, rows = stored(m, 0, sorted(reference))
    torch.testing.assert_close(rows[:, :D], torch.stack([reference[k] for k in sorted(reference)]), atol=1e-5,
                               rtol=0)


def test_budget_below_one_growth_step_is_refused_before_allocating(device, monkeypatch):
    # One byte short of the next doubling: the table never grows, and the
    # error is ours (not an allocation failure from the rehash).
    m = _module(DynamicEmbCheckMode.ERROR, budget=table_bytes(2 * MAX_CAP, ROW_BYTES) - 1, device=device)

    def no_growth(*args, **kwargs):
        raise AssertionError("grew past the budget")
    monkeypatch.setattr(ScoredHashTable, "grow", no_growth)
    with pytest.raises(DynamicEmbBudgetError) as e:
        m(torch.arange(1000, device=device), torch.arange(1001, device=device))
    assert type(e.value) is DynamicEmbBudgetError and "'keep'" in str(e.value)
    assert m.table_stats()["keep"]["capacity"] == MAX_CAP


def test_loading_past_the_budget_names_the_budget(device):
    m = _module(budget=table_bytes(2 * MAX_CAP, ROW_BYTES), device=device)
    keys = torch.arange(500)
    batch = RowBatch(keys, debug_rows(keys.tolist(), D), None, torch.zeros_like(keys), None)
    with pytest.raises(DynamicEmbBudgetError, match="'keep'.*memory_budget"):
        m.storage.load_rows(0, batch)
    assert m.table_stats()["keep"]["capacity"] == 2 * MAX_CAP


def test_memory_missing_within_the_budget_degrades_to_failed_inserts(device, monkeypatch):
    # The budget allows growth, but the allocator refuses rows past 64 (as a
    # device out of memory would): the table stops there, nothing moved,
    # its new keys fail (counted, named), and what it stored stays.
    from dynamicemb.storage import HashTableStorage
    new_rows = HashTableStorage._new_rows

    def refusing(self, t, rows, width):
        if rows > 2 * MAX_CAP:
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {rows * width * 4}")
        return new_rows(self, t, rows, width)
    monkeypatch.setattr(HashTableStorage, "_new_rows", refusing)
    m = _module(budget=1 << 20, device=device)
    reference, warned = {}, []
    _train(m, _batches(300, 3), device, reference, warned)
    stats = m.table_stats()["keep"]
    assert stats["capacity"] == 2 * MAX_CAP and stats["failed"] > 0 and stats["size"] == len(reference)
    assert any("the allocation failed" in w and "'keep'" in w for w in warned)
    _check_rows(m, reference)
    strict = _module(DynamicEmbCheckMode.ERROR, budget=1 << 20, device=device)
    with pytest.raises(DynamicEmbBudgetError, match="'keep' could not grow past 64 slots.*can't allocate memory"):
        strict(torch.arange(300, device=device), torch.arange(301, device=device))


@pytest.mark.parametrize("mode", [DynamicEmbCheckMode.IGNORE, DynamicEmbCheckMode.WARNING], ids=lambda m: m.name)
def test_failures_read_no_size_unless_a_budget_explains_them(mode, monkeypatch):
    # A table's size (on CUDA a wait for the device) is read to report failed
    # keys only for the message naming a memory budget, once per table: never
    # under IGNORE, and not for a table whose failures its budget does not explain.
    reads = []
    size = ScoredHashTable.size
    monkeypatch.setattr(ScoredHashTable, "size", lambda self, t=None: reads.append(t) or size(self, t))
    evicting = make_module([D], max_capacity=16, bucket_capacity=16, safe_check_mode=mode,
                           score_strategy=DynamicEmbScoreStrategy.TIMESTAMP)
    budgeted = _module(mode, budget=table_bytes(MAX_CAP, ROW_BYTES))  # at its budget from the start
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        evicting(torch.arange(40), torch.arange(41))  # one bucket held by the batch: 24 keys fail
        assert int(evicting.failed[0]) == 24 and reads == []
        budgeted(torch.arange(100), torch.arange(101))
        budgeted(torch.arange(100, 150), torch.arange(51))  # fails again: explained already
    assert int(budgeted.failed[0]) == 150 - MAX_CAP
    explained = [str(w.message) for w in warned if "memory_budget" in str(w.message)]
    assert reads == ([0] if mode == DynamicEmbCheckMode.WARNING else [])  # the budget's message only
    assert len(explained) == (1 if mode == DynamicEmbCheckMode.WARNING else 0)


def test_a_step_failing_at_a_budget_and_at_a_full_bucket_is_no_budget_error():
    """Two ERROR tables fail in one step, one at its memory budget and one
    for a full bucket: the error names both, and is a plain RuntimeError (a
    DynamicEmbBudgetError's handler raises budgets, which would not help the
    second table)."""
    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions
    common = dict(dim=D, max_capacity=16, bucket_capacity=16, initializer_args=DEBUG_INIT,
                  safe_check_mode=DynamicEmbCheckMode.ERROR)
    m = BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(score_strategy=DynamicEmbScoreStrategy.NO_EVICTION,
                                memory_budget=table_bytes(16, ROW_BYTES), **common),
         DynamicEmbTableOptions(**common)],
        table_names=["budgeted", "bucket"], pooling_mode=DynamicEmbPoolingMode.NONE)
    with pytest.raises(RuntimeError) as e:
        m(torch.cat([torch.arange(20), torch.arange(20)]), torch.tensor([0, 20, 40]))
    assert type(e.value) is RuntimeError, type(e.value)
    assert "table 'budgeted': 4 keys could not be stored" in str(e.value) and "memory_budget" in str(e.value)
    assert "table 'bucket': 4 keys could not be stored" in str(e.value)
