"""A model that gained a table since its checkpoint (the usual "add a table,
fine-tune from the old checkpoint"): dcp.load with DCP's partial load
(allow_partial_load) then load_state_dict(strict=False) restores the saved
table and reports the new one missing, leaving it as it is. DCP's partial
load leaves the entries it did not find as None; they were taken for
damaged slots, and nothing was loaded."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchrec"))
import models  # noqa: E402
from ckpt_helpers import run_in_scratch  # noqa: E402

ROWS, DIM = 64, 4


def _build(names, pg):
    configs = models.ebc_configs(names, dim=DIM, num_embeddings=ROWS)
    return models.build("ebc", configs, pg, models.dynamic_constraints(names), models.SGD)


def _partial_load(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    pg = models.rank_groups()[0]
    g = torch.Generator().manual_seed(0)  # the same rows on every rank
    saved_rows, new_rows = torch.rand(ROWS, DIM, generator=g), torch.rand(ROWS, DIM, generator=g)
    old = _build(["a_table"], pg)
    models.set_dynamic_rows(old, "a_table", saved_rows, pg)
    dcp.save(old.state_dict(), checkpoint_id=root, process_group=pg)

    new = _build(["a_table", "b_table"], pg)
    models.set_dynamic_rows(new, "b_table", new_rows, pg)
    sd = new.state_dict()
    dcp.load(sd, checkpoint_id=root, process_group=pg, planner=DefaultLoadPlanner(allow_partial_load=True))
    result = new.load_state_dict(sd, strict=False)
    a, a_owner = models.stored_rows(new, "a_table", torch.arange(ROWS), pg)
    b, b_owner = models.stored_rows(new, "b_table", torch.arange(ROWS), pg)
    return dict(missing=list(result.missing_keys), unexpected=list(result.unexpected_keys),
                a_stored=bool((a_owner >= 0).all()), a_diff=float((a[:, :DIM] - saved_rows).abs().max()),
                b_stored=bool((b_owner >= 0).all()), b_diff=float((b[:, :DIM] - new_rows).abs().max()))


def test_a_table_added_since_the_checkpoint_is_reported_missing_and_the_others_load():
    for r in run_in_scratch("dynamicemb-dcp-partial-", _partial_load, 2):
        assert r["missing"] == ["embedding_bags.b_table.dynamicemb"] and r["unexpected"] == [], r
        assert r["a_stored"] and r["a_diff"] == 0.0, r  # the saved table, restored on every rank
        assert r["b_stored"] and r["b_diff"] == 0.0, r  # the new table, as it was
