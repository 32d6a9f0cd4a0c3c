"""Under safe_check_mode ERROR, a step whose keys do not fit a table's
cache fails with a RuntimeError that names the table and the size it needs,
loses no row, and the size it names is enough (WARNING and IGNORE degrade
instead: test_cache_overflow.py): a module (and a 2-rank DMP model) given that
global_hbm_for_values trains the step as all-in-memory tables do."""
import re

import pytest
import torch
import torch.distributed as dist

import tiered_dmp as td
from dynamicemb import DynamicEmbCheckMode
from dynamicemb.tiers import HostStore
from tier_helpers import BUCKET, DIM, all_rows, module, step
from tiered_dmp import models, run_ranks

ERROR = DynamicEmbCheckMode.ERROR
_NEEDED = re.compile(r"global_hbm_for_values >= (\d+) bytes: (\d+) on each of its (\d+) ranks")


def _needed_bytes(message: str, tables, ranks: int) -> int:
    """The global_hbm_for_values the error asks for; checks that it names one
    of `tables` and splits the bytes over `ranks` ranks."""
    assert "cannot hold one step's rows" in message and any(f"table {t!r}" in message for t in tables), message
    m = _NEEDED.search(message)
    assert m is not None, message
    total, per_rank, shards = map(int, m.groups())
    assert shards == ranks and total == per_rank * ranks, message
    return total


def test_module_error_names_the_table_and_a_size_that_works():
    # 16 bags per feature: 64 keys for t0 (bags of 4), 16 for t1 (bags of 1).
    ids = torch.cat([torch.arange(64) * 7 + 3, torch.arange(16)])
    lengths = torch.tensor([4] * 16 + [1] * 16)
    batch = (ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
    small = module(store=HostStore(bucket_capacity=BUCKET), cache_rows=2 * BUCKET, safe_check_mode=ERROR)
    with pytest.raises(RuntimeError, match="cannot hold") as err:
        step(small, batch)
    needed = _needed_bytes(str(err.value), ["t0"], ranks=1)
    # Nothing is lost or doubled: the keys that found a slot are in one tier, once.
    assert set(all_rows(small, 0)) <= set(ids[:64].tolist())

    rows = needed // (DIM * 4)  # EXACT_SGD: a row is its float32 value
    big = module(store=HostStore(bucket_capacity=BUCKET), cache_rows=rows)
    assert big.table_stats()["t0"]["cache_capacity"] == rows < 64 * 4
    ref = module()
    assert torch.equal(step(big, batch), step(ref, batch))
    assert torch.equal(step(big, batch), step(ref, batch))  # and again, now that the keys are cached


def test_error_counts_a_batch_s_failed_keys_once_whether_prefetch_or_forward_raises():
    """Under ERROR, `failed` counts the keys of a batch that raised because
    the cache could not hold them: when its prefetch raises (TorchRec's
    prefetch pipeline may then never run its forward), and when its forward
    does; a batch whose prefetch and forward both raise counts once."""
    ids, offsets = torch.arange(200) * 7, torch.tensor([0, 200])
    counts = {}
    for case in ("forward", "prefetch", "both"):
        m = module(store=HostStore(bucket_capacity=BUCKET), cache_rows=2 * BUCKET, tables=1, safe_check_mode=ERROR)
        if case != "forward":
            with pytest.raises(RuntimeError, match="cannot hold"):
                m.prefetch(ids, offsets)
        if case != "prefetch":
            with pytest.raises(RuntimeError, match="cannot hold"):
                m(ids, offsets)
        counts[case] = m.table_stats()["t0"]["failed"]
        assert m.table_stats()["t0"]["size"] == 0  # a raising step stores nothing
    assert counts["forward"] > 0 and counts["prefetch"] == counts["forward"] == counts["both"], counts


def _dmp_too_small(rank, world):
    pg = dist.group.WORLD
    # 200 distinct keys per table: ~100 per rank, far more than one bucket.
    batch = {f: [[k * 13 + 1, k * 13 + 2] for k in range(100)] for f in td.FEATURES}
    small = td.build("ebc", pg, models.SGD, cache_rows=2 * td.BUCKET, safe_check_mode=ERROR)  # one bucket per rank
    with pytest.raises(RuntimeError, match="cannot hold") as err:
        small(td.local_kjt(batch, pg))
    needed = torch.tensor(_needed_bytes(str(err.value), td.TABLES, ranks=world))
    dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=pg)  # the largest any rank asked for

    fitted = td.build("ebc", pg, models.SGD, caching=True, global_hbm_for_values=int(needed))
    ref = td.build("ebc", pg, models.SGD)
    for _ in range(2):
        assert torch.equal(*td.train(fitted, [batch], pg), *td.train(ref, [batch], pg))
    td.assert_same_rows(fitted, ref, pg, "fitted cache")
    return int(needed)


def test_dmp_error_names_the_table_and_a_size_that_works():
    needed = run_ranks(_dmp_too_small, 2)
    assert needed[0] == needed[1] > 0


def test_a_failed_step_leaves_every_row_where_it_was():
    """The keys a failing step took from the store go back with their rows,
    and its new keys are not kept: both tiers hold what they held before."""
    m = module(store=HostStore(bucket_capacity=BUCKET), cache_rows=2 * BUCKET, safe_check_mode=ERROR)
    stored = torch.arange(20) * 7 + 3
    step(m, (torch.cat([stored, torch.arange(4)]), torch.tensor([0, 20, 24])))
    m.flush()  # every row is in the store now
    before = all_rows(m, 0)
    ids = torch.cat([stored, torch.arange(1000, 1100), torch.arange(4)])
    assert m.table_stats()["t0"]["failed"] == 0
    with pytest.raises(RuntimeError, match="cannot hold"):
        step(m, (ids, torch.tensor([0, 120, 124])))
    # The keys that found no slot are counted (at most the 120 distinct keys of t0; the cache holds 32).
    assert 120 - 2 * BUCKET <= m.table_stats()["t0"]["failed"] <= 120
    after = all_rows(m, 0)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert m.table_stats()["t0"]["store_rows"] == len(before)


def test_keys_another_group_placed_before_the_failure_hold_their_initial_rows():
    """Table 0 (no cache: a group of its own) is inserted before table 1's
    too-small cache fails the step: table 0's new keys keep the initial rows
    an all-in-memory module gives them, not what their slots held before."""
    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions, EmbOptimType

    def two_groups(cache_rows):
        opts = [DynamicEmbTableOptions(dim=DIM, max_capacity=1 << 12, bucket_capacity=BUCKET),
                DynamicEmbTableOptions(dim=DIM, max_capacity=1 << 12, bucket_capacity=BUCKET, caching=True,
                                       global_hbm_for_values=cache_rows * DIM * 4,
                                       backing_store=HostStore(bucket_capacity=BUCKET), safe_check_mode=ERROR)]
        return BatchedDynamicEmbeddingTables(opts, table_names=["plain", "cached"], optimizer=EmbOptimType.EXACT_SGD,
                                             learning_rate=0.1, seed=3)

    small, ref = two_groups(2 * BUCKET), two_groups(1024)
    assert len(small.storage.groups) == 2
    ids = torch.cat([torch.arange(100) * 13 + 5, torch.arange(1000, 1100)])  # 100 keys each
    offsets = torch.tensor([0, 100, 200])
    for m in (small, ref):  # fill table 0's slots with other keys' trained rows first
        step(m, (torch.cat([torch.arange(50) * 17 + 2, torch.arange(2000, 2004)]), torch.tensor([0, 50, 54])))
    with pytest.raises(RuntimeError, match="cannot hold"):
        step(small, (ids, offsets))
    ref(ids, offsets)  # inserts without training: table 0's new keys at their initial rows
    got, want = all_rows(small, 0), all_rows(ref, 0)
    assert got.keys() == want.keys() and len(got) > 100
    assert all(torch.equal(got[k], want[k]) for k in want)
