"""torch.compile of a whole DMP model with dynamic tables trains as the
eager model does, for tables that grow (init_capacity < max_capacity) and
cached ones. A training forward's host-side work (dedup, insert, counters)
runs eagerly, at a graph break: traced, it failed inside the storage (under
dynamo, `results == InsertResult.FAILED` gave the bool False: "bincount only
supports 1-d non-negative integral inputs"), and dynamo guarded on the step
counters, compiling the graphs again every step."""
import pytest
import torch

import dynamicemb
import models
from multiprocess import run_ranks

TABLES = ["a_table", "b_table"]
FEATURES = [t.replace("table", "feature") for t in TABLES]
KEYS, BATCH, STEPS, DIM = 200, 16, 4, 4
ROW_BYTES = dynamicemb.get_table_value_bytes(1, DIM, optimizer=models.SGD["optimizer"])
OPTIONS = {"growing": dict(init_capacity=128, max_capacity=1024),
           "cached": dict(caching=True, global_hbm_for_values=256 * ROW_BYTES)}


class _Loss(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt):
        return ((self.ebc(kjt).values() - 0.5) ** 2).sum()


def _compiled_against_eager(rank, world, kind):
    """Per mode (eager, compiled): each step's loss and the tables' rows after them (plain values)."""
    pg = models.rank_groups()[0]
    configs = models.ebc_configs(TABLES, dim=DIM, num_embeddings=KEYS)
    batches = [models.kjt(models.random_batch(FEATURES, BATCH, KEYS, seed=40 + s)) for s in range(STEPS)]
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model = models.build("ebc", configs, pg, models.dynamic_constraints(TABLES, **OPTIONS[kind]), models.SGD,
                             wrap=_Loss)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        losses, graphs = [], []
        for kjt in batches:
            loss = run(kjt)
            loss.backward()
            losses.append(float(loss))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        out[compiled] = (losses, models.every_row(model, TABLES, pg), graphs)
    return out


@pytest.mark.parametrize("kind", list(OPTIONS))
def test_a_compiled_model_trains_as_the_eager_one(kind):
    out = run_ranks(_compiled_against_eager, 1, kind)[0]
    (eager_losses, eager_rows, _), (losses, rows, graphs) = out[False], out[True]
    assert losses == eager_losses
    assert all(rows[t] for t in TABLES) and rows == eager_rows
    # Not compiled again from step to step (the step counters, once traced, were guarded on: a recompile a step).
    assert graphs[1] == graphs[-1] > 0, graphs
