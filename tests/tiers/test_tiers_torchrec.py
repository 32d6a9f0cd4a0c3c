"""Cached dynamic tables under DistributedModelParallel (our planner and
sharders, CPU, gloo): a cache of ~10% of the keys in front of a host store
trains exactly as all-in-memory dynamic tables, on 1 and 2 ranks, EBC and
EC, SGD and Adam (same outputs at every step, same rows and optimizer state
at the end); TorchRec's state_dict() (which flushes every lookup) leaves the
caches alone; a dump of a cached 2-rank model sees both tiers and loads into
an all-in-memory 1-rank model and into a cached 2-rank model."""
import pytest
import torch

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
    for pg in models.rank_groups():
        for kind in ("ebc", "ec"):
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
            checked.append(what)
    return checked


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_cached_dmp_trains_as_all_in_memory(optimizer):
    checked = run_ranks(_cached_equals_all_in_memory, 2, optimizer)
    assert checked[0] == checked[1] and len(checked[0]) == 4


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

    # Into an all-in-memory model on 1 rank: the same rows, whichever tier they were in.
    in_memory = td.build("ebc", own_pg, fused)
    DynamicEmbLoad(path, in_memory, pg=own_pg)
    td.assert_same_rows(in_memory, cached, own_pg, "1-rank all-in-memory load", ref_pg=world_pg)

    # Into a fresh cached 2-rank model: the same rows, and training resumes as
    # the dumped model's does (Adam's step count came with the dump).
    resumed = td.build("ebc", world_pg, fused, cache_rows=td.CACHE_ROWS)
    DynamicEmbLoad(path, resumed, pg=world_pg)
    td.assert_same_rows(resumed, cached, world_pg, "2-rank cached load")
    for step, (a, b) in enumerate(zip(td.train(resumed, batches[50:], world_pg),
                                      td.train(cached, batches[50:], world_pg))):
        assert torch.equal(a, b), f"resumed step {step}: outputs differ"
    td.assert_same_rows(resumed, cached, world_pg, "after resuming")
    loaded = dynamicemb.table_stats(resumed, world_pg)
    return {t: loaded[t]["size"] for t in td.TABLES}


def test_dump_of_cached_model_loads_anywhere(tmp_path):
    sizes = run_ranks(_dump_and_load, 2, str(tmp_path / "dump"))
    assert sizes[0] == sizes[1] and all(n > td.CACHE_ROWS * 5 for n in sizes[0].values())
