"""dcp.save(model.state_dict()) / dcp.load keep cached tables whole: one
table caches its rows in front of a host store, another in front of a
FileStore, with caches far smaller than the keys trained (so the rows saved
live in both tiers). On 1, 2 and 3 ranks the fresh model gets every entry
back (read through both tiers), identical eval outputs and identical further
training; 1 -> 2 -> 3 and 3 -> 1 put every key once on its owner."""
import pytest

import dcp_helpers as D

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
