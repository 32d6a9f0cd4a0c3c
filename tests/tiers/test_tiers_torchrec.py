"""Cached dynamic tables under DistributedModelParallel (our planner and
sharders, CPU, gloo): a cache of ~10% of the keys in front of a host store
trains exactly as all-in-memory dynamic tables (EBC on 1 and 2 ranks, EC on
2; SGD and Adam): the same outputs at every step, the same rows and
optimizer state at the end, the same eval outputs over both tiers.
TorchRec's state_dict() (which flushes every lookup) leaves the caches
alone; a dump of a cached 2-rank model sees both tiers and loads into an
all-in-memory 1-rank model and into a cached 2-rank model; a FileStore
(storage_path) and a user's BackingStore given in the options work too."""
import os

import pytest
import torch
import torch.distributed as dist

import dynamicemb
import tiered_dmp as td
from dynamicemb import DynamicEmbDump, DynamicEmbLoad
from tiered_dmp import models, run_ranks


def _check_tiers(cached, ref, pg, fused, what):
    stats, ref_stats = dynamicemb.table_stats(cached, pg), dynamicemb.table_stats(ref, pg)
    per_rank = td.local_cache_rows(fused, td.CACHE_ROWS, pg.size())
    for t in td.TABLES:
        s = stats[t]
        assert ref_stats[t]["evicted"] == 0 and s["evicted"] == 0 and s["failed"] == 0, f"{what} {t}: {s}"
        assert s["size"] == ref_stats[t]["size"] == s["inserted"], f"{what} {t}: {s} vs {ref_stats[t]}"
        # Each rank caches its share of global_hbm_for_values: ~10% of the keys in all.
        assert s["cache_capacity"] == per_rank * pg.size(), f"{what} {t}: {s}"
        assert s["cache_rows"] <= s["cache_capacity"] <= 0.11 * s["size"], f"{what} {t}: {s}"
        assert s["cache_rows"] + s["store_rows"] == s["size"], f"{what} {t}: {s}"
        assert s["write_backs"] > 0 and s["hits"] > 0 and s["misses"] > s["inserted"], f"{what} {t}: {s}"


def _cached_equals_all_in_memory(rank, world, optimizer):
    fused = td.OPTIMIZERS[optimizer]
    batches = td.zipf_batches()
    checked = []
    for pg in td.process_groups():
        for kind in ("ebc", "ec") if pg.size() > 1 else ("ebc",):  # EC: the same kernel path
            what = f"{kind}/{optimizer}/{pg.size()} ranks"
            ref = td.build(kind, pg, fused)
            cached = td.build(kind, pg, fused, cache_rows=td.CACHE_ROWS)
            ref_out = td.train(ref, batches, pg)

            def state_dict_mid_step(step):
                if step == 10:  # between a forward and its backward
                    before = dynamicemb.table_stats(cached)
                    cached.state_dict()
                    assert dynamicemb.table_stats(cached) == before, f"{what}: state_dict() moved rows"

            out = td.train(cached, batches, pg, between=state_dict_mid_step)
            for step, (a, b) in enumerate(zip(out, ref_out)):
                assert torch.equal(a, b), f"{what}: step {step} outputs differ"
            _check_tiers(cached, ref, pg, fused, what)
            td.assert_same_rows(cached, ref, pg, what)
            # Eval reads both tiers and moves nothing (unseen keys included).
            before = dynamicemb.table_stats(cached)
            for m in (cached, ref):
                m.eval()
            kjt = td.local_kjt(td.zipf_batches(steps=1, seed=1)[0], pg)
            a, b = (models.output_values(models.resolved(m(kjt))) for m in (cached, ref))
            assert torch.equal(a, b) and dynamicemb.table_stats(cached) == before, f"{what}: eval"
            checked.append(what)
    return checked


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_cached_dmp_trains_as_all_in_memory(optimizer):
    checked = run_ranks(_cached_equals_all_in_memory, 2, optimizer)
    assert len(checked[0]) == 3 and checked[1] == checked[0][:2]  # rank 0 also ran the 1-rank models


def _dump_and_load(rank, world, path):
    world_pg, own_pg = models.rank_groups()
    fused = td.OPTIMIZERS["adam"]
    batches = td.zipf_batches(steps=60)
    cached = td.build("ebc", world_pg, fused, cache_rows=td.CACHE_ROWS)
    td.train(cached, batches[:50], world_pg)
    before = dynamicemb.table_stats(cached, world_pg)
    assert all(before[t]["store_rows"] > 0 and before[t]["cache_rows"] > 0 for t in td.TABLES), before
    DynamicEmbDump(path, cached, pg=world_pg)
    assert dynamicemb.table_stats(cached, world_pg) == before, "the dump moved rows between tiers"
    dumped = {t: td.all_rows(cached, t, world_pg) for t in td.TABLES}

    # Into a fresh cached 2-rank model: the same rows, and training resumes as
    # the dumped model's does (Adam's step count came with the dump).
    resumed = td.build("ebc", world_pg, fused, cache_rows=td.CACHE_ROWS)
    DynamicEmbLoad(path, resumed, pg=world_pg)
    td.assert_same_rows(resumed, cached, world_pg, "2-rank cached load")
    for step, (a, b) in enumerate(zip(td.train(resumed, batches[50:], world_pg),
                                      td.train(cached, batches[50:], world_pg))):
        assert torch.equal(a, b), f"resumed step {step}: outputs differ"
    td.assert_same_rows(resumed, cached, world_pg, "after resuming")

    # Into an all-in-memory model on 1 rank (rank 0's, once): the same rows,
    # whichever tier they were dumped from.
    if dist.get_rank() == 0:
        in_memory = td.build("ebc", own_pg, fused)
        DynamicEmbLoad(path, in_memory, pg=own_pg)
        for t in td.TABLES:
            keys, rows = td.all_rows(in_memory, t, own_pg)
            assert torch.equal(keys, dumped[t][0]) and torch.equal(rows, dumped[t][1]), f"1-rank load {t}"
    return {t: before[t]["size"] for t in td.TABLES}


def test_dump_of_cached_model_loads_anywhere(tmp_path):
    sizes = run_ranks(_dump_and_load, 2, str(tmp_path / "dump"))
    assert sizes[0] == sizes[1] and all(n > td.CACHE_ROWS * 5 for n in sizes[0].values())


def _stores(rank, world, path):
    from tier_helpers import DictStore
    pg = dist.group.WORLD
    batches = td.zipf_batches(steps=40)
    ref = td.build("ebc", pg, models.SGD)
    ref_out = td.train(ref, batches, pg)
    user_store = DictStore()
    for what, store in (("storage_path", dict(storage_path=path)), ("backing_store", dict(backing_store=user_store))):
        cached = td.build("ebc", pg, models.SGD, cache_rows=td.CACHE_ROWS, **store)
        for step, (a, b) in enumerate(zip(td.train(cached, batches, pg), ref_out)):
            assert torch.equal(a, b), f"{what}: step {step} outputs differ"
        td.assert_same_rows(cached, ref, pg, what)
        stats = dynamicemb.table_stats(cached)  # this rank's
        assert all(stats[t]["store_rows"] > 0 for t in td.TABLES), f"{what}: {stats}"
    # The user's store (one object for both tables of a rank) holds this rank's store rows.
    assert {t: len(user_store.tables[t]) for t in td.TABLES} == {t: stats[t]["store_rows"] for t in td.TABLES}
    return sorted(os.listdir(path))


def test_file_and_user_stores_through_dmp(tmp_path):
    """storage_path (a FileStore per rank) and a user's BackingStore object
    given in the options reach each rank's kernel and train as all-in-memory."""
    listed = run_ranks(_stores, 2, str(tmp_path / "store"))
    assert listed[0] == listed[1] == ["rank00000", "rank00001"]
