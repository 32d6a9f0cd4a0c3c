"""reset_parameters() of a sharded collection re-initialises a dynamic table
as it does a native one: the table is emptied, so every key reads its
initial row again (a function of the seed, the table and the key) when it
next comes. Before, a reset kept every trained dynamic row, silently. The
reference is a fresh model of the same tables."""
import torch

import models
from dynamicemb.stats import table_stats
from multiprocess import run_ranks

TABLES = ["a_table", "b_table"]
FEATURES = [t.replace("table", "feature") for t in TABLES]


def _reset(rank, world):
    pg = models.rank_groups()[0]
    out = {}
    for kind in ("ebc", "ec"):
        configs = (models.ec_configs if kind == "ec" else models.ebc_configs)(TABLES, dim=4, num_embeddings=64)
        trained, fresh = (models.build(kind, configs, pg, models.dynamic_constraints(TABLES),
                                       models.SGD) for _ in range(2))
        for step in range(2):
            batch = models.kjt(models.random_batch(FEATURES, 4, 64, seed=step), models.local_samples(4, pg))
            models.loss_of(trained(batch)).backward()
        stored = sum(s["size"] for s in table_stats(trained, pg).values())
        trained.module.reset_parameters()
        left = sum(s["size"] for s in table_stats(trained, pg).values())
        batch = models.kjt(models.random_batch(FEATURES, 4, 64, seed=0), models.local_samples(4, pg))
        got, want = models.output_values(trained(batch)), models.output_values(fresh(batch))
        out[kind] = dict(stored=stored, left=left, diff=float((got - want).abs().max()),
                         norm=float(want.abs().max()))
    return out


def test_reset_parameters_empties_dynamic_tables_so_keys_read_their_initial_rows():
    for r in run_ranks(_reset, 2):
        for kind, got in r.items():
            assert got["stored"] > 0 and got["left"] == 0, (kind, got)
            assert got["diff"] == 0.0 and got["norm"] > 0, (kind, got)  # the initial rows, as a fresh model reads them
