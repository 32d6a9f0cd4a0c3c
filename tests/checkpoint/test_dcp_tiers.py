"""dcp.save(model.state_dict()) / dcp.load keep cached tables whole: one
table caches its rows in front of a host store, another in front of a
FileStore, with caches far smaller than the keys trained (so the rows saved
live in both tiers). On 1, 2 and 3 ranks the fresh model gets every entry
back (read through both tiers), identical eval outputs and identical further
training; 1 -> 2 -> 3 and 3 -> 1 put every key once on its owner."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

import ckpt_helpers as H
import dcp_helpers as D
from dynamicemb import EmbOptimType, get_table_value_bytes, table_stats

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchrec"))
from models import every_row  # noqa: E402

OPTIMIZER = "adam"


@pytest.mark.parametrize("w", D.SIZES)
def test_cached_and_file_store_tables_round_trip_and_train_on(w):
    ranks = D.results(OPTIMIZER, True)
    for r in ranks:
        if w in r:
            stats = r[w]["saved"]["stats"]
            for t in (D.CACHED, D.FILED):
                assert stats[t]["cache_rows"] > 0 and stats[t]["store_rows"] > 0, f"{t}: {stats[t]}"
    D.check_round_trip(ranks, w)


@pytest.mark.parametrize("direction", ["1->2", "2->3", "3->1"])
def test_cached_and_file_store_tables_reshard(direction):
    D.check_reshard(D.results(OPTIMIZER, True), direction)


def _full_cache_round_trip(rank, world, root):
    """A cached table trained past its maximum (its store full, its cache
    full: more rows than max_capacity), saved by DCP and loaded into the
    same fresh model: each table's rows, before and after."""
    pg = dist.GroupMember.WORLD
    cache = get_table_value_bytes(32, 8, torch.float32, EmbOptimType.ADAM)
    opts = {"t_hash": dict(caching=True, bucket_capacity=16, global_hbm_for_values=cache)}
    a = H.build(pg, num_embeddings=128, **opts)
    H.train(a, pg, range(1, 40))
    stats = table_stats(a)["t_hash"]
    before = every_row(a, ["t_hash"], pg)
    D.save(a, f"{root}/dcp", pg)
    b = H.build(pg, num_embeddings=128, **opts)
    D.load(b, f"{root}/dcp", pg)
    return stats, before, every_row(b, ["t_hash"], pg)


def test_a_full_cached_tables_checkpoint_loads_into_the_same_model():
    (stats, before, after), = H.run_in_scratch("dcp_full_cache", _full_cache_round_trip, 1)
    assert stats["size"] > stats["capacity"] and stats["cache_rows"] == stats["cache_capacity"]
    assert after == before
