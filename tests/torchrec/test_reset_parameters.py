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
        configs = models.configs_of(kind, TABLES, dim=4, num_embeddings=64)
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


def _reopened(rank, world, root):
    """A cached table on a FileStore, trained, closed, then built again on
    the same storage_path: TorchRec's reset_parameters while it builds the
    collection must leave the rows the table resumes."""
    from dynamicemb.stats import dynamic_modules
    pg = models.rank_groups()[0]
    configs = models.ebc_configs(TABLES, dim=4, num_embeddings=64)
    options = dict(caching=True, global_hbm_for_values=128 * 4 * 4 * world, storage_path=root, bucket_capacity=16)
    first = models.build("ebc", configs, pg, models.dynamic_constraints(TABLES, **options), models.SGD)
    for step in range(2):
        batch = models.kjt(models.random_batch(FEATURES, 4, 64, seed=step), models.local_samples(4, pg))
        models.loss_of(first(batch)).backward()
    want = models.every_row(first, TABLES, pg)
    for m in dynamic_modules(first):
        m.close()
    again = models.build("ebc", configs, pg, models.dynamic_constraints(TABLES, **options), models.SGD)
    return want, models.every_row(again, TABLES, pg)


def test_a_table_reopened_on_its_file_store_keeps_its_rows_through_the_build(tmp_path):
    for want, got in run_ranks(_reopened, 2, str(tmp_path)):
        assert all(want[t] for t in TABLES) and got == want
