"""A dump loads on another world size: 2 -> 1, 2 -> 3 and 1 -> 2 ranks,
for each dist_type (one table each: hash_roundrobin, roundrobin,
continuous; plus a sequence table). Every dumped key is loaded exactly
once, on the rank dynamicemb.routing.owners gives it, with its value, Adam
state and score, and the eval outputs equal the original model's."""
import os

import pytest
import torch.distributed as dist

import ckpt_helpers as H
from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad

OTHER_NUM_EMB = 3000


def _dump(pg, path):
    model = H.build(pg)
    H.train(model, pg, [1, 2, 3])
    out = dict(orig=H.gathered_entries(model, pg), orig_out=H.probe(model), dumped_ns=H.now_ns())
    DynamicEmbDump(path, model, pg=pg)
    return out


def _load(pg, path, num_embeddings=H.NUM_EMB):
    model = H.build(pg, num_embeddings=num_embeddings)
    DynamicEmbLoad(path, model, pg=pg)
    return dict(loaded_ns=H.now_ns(), loaded=H.gathered_entries(model, pg), loaded_out=H.probe(model))


def _reshard(rank, world, root):
    """3 ranks: rank 0 alone and ranks {0, 1} train and dump; then the
    2-rank dump loads on all 3 ranks and on rank 2 alone, and the 1-rank
    dump on ranks {0, 1}; "2->2": the 2-rank dump into a model of another
    num_embeddings (which moves continuous routing's blocks)."""
    own = [dist.new_group([r]) for r in range(world)]
    pair = dist.new_group([0, 1])
    from1, from2 = os.path.join(root, "from1"), os.path.join(root, "from2")
    res = {}
    if rank == 0:
        res["dump1"] = _dump(own[0], from1)
    if rank in (0, 1):
        res["dump2"] = _dump(pair, from2)
    dist.barrier()
    res["2->3"] = _load(dist.GroupMember.WORLD, from2)
    if rank == 2:
        res["2->1"] = _load(own[2], from2)
    else:
        res["1->2"] = _load(pair, from1)
        # Same world size, but continuous routing changes with num_embeddings.
        res["2->2"] = _load(pair, from2, num_embeddings=OTHER_NUM_EMB)
    dist.barrier()
    return res


@H.once
def _results():
    return H.run_in_scratch("dynamicemb-reshard-", _reshard, 3)


@pytest.mark.parametrize("table", list(H.TABLES), ids=lambda t: f"{t}-{H.TABLES[t][1]}")
@pytest.mark.parametrize("direction", ["2->1", "2->3", "1->2", "2->2"])
def test_reshard(direction, table):
    ranks = _results()
    src = "dump" + direction[0]
    dumps = [r[src] for r in ranks if src in r]
    loads = [r[direction] for r in ranks if direction in r]
    orig, loaded = dumps[0]["orig"], loads[0]["loaded"]
    assert len(orig) == int(direction[0]) and len(loaded) == int(direction[-1])
    # Every rank holds keys of the table, so that routing is really exercised.
    assert all(e[table]["keys"].numel() >= 3 for e in orig + loaded)
    H.assert_same_entries(orig, loaded, min(d["dumped_ns"] for d in dumps), max(x["loaded_ns"] for x in loads),
                          dist_types={table: H.TABLES[table][1]},
                          num_embeddings=OTHER_NUM_EMB if direction == "2->2" else H.NUM_EMB)
    # The modules' step and Adam step count come back whatever the layout.
    assert {m[1:] for e in loaded for m in e["_modules"]} == {(3, 3)}
    for x in loads:
        H.assert_same_outputs(x["loaded_out"], dumps[0]["orig_out"], exact=False)
