"""Spawned multi-rank runs shared by several test files. A spawn costs
seconds of imports per rank on a small shared machine, so one run does the
work of several tests and returns plain data; each test asserts its part.
Results are cached per pytest session (tmp dirs come from the caller)."""
import os

import torch.distributed as dist

import ckpt_helpers as H
from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad
from dynamicemb.incremental_dump import get_score, incremental_dump


def _round_trip(pg, path):
    """Train 3 steps, dump, load into a fresh model; then 2 more steps on
    the loaded model and 5 steps straight on another fresh one."""
    model = H.build(pg)
    H.train(model, pg, [1, 2, 3])
    out = dict(orig_out=H.probe(model), orig=H.gathered_entries(model, pg))
    out["dumped_ns"] = H.now_ns()
    DynamicEmbDump(path, model, pg=pg)
    fresh = H.build(pg)
    DynamicEmbLoad(path, fresh, pg=pg)
    out["loaded_ns"] = H.now_ns()
    out.update(loaded=H.gathered_entries(fresh, pg), loaded_out=H.probe(fresh))
    H.train(fresh, pg, [4, 5])
    straight = H.build(pg)
    H.train(straight, pg, [1, 2, 3, 4, 5])
    out.update(continued=H.gathered_entries(fresh, pg), continued_out=H.probe(fresh),
               straight=H.gathered_entries(straight, pg), straight_out=H.probe(straight))
    return out


def _incremental(pg):
    """Two incremental dumps: after steps 1-2 (thresholds taken then) and
    step 3, then with the returned thresholds after step 4."""
    model = H.build(pg)
    H.train(model, pg, [1, 2])
    clock = H.now_ns()  # TIMESTAMP tables: the keys touched after this reading
    score = get_score(model)  # the STEP table's step: 2
    H.train(model, pg, [3])
    thresholds = {"t_hash": score["t_hash"] + 1, "t_rr": 2, "t_cont": clock, "t_seq": clock}  # t_rr (LFU): count
    first, nxt = incremental_dump(model, thresholds, pg=pg)
    out = dict(score=score, first=first, next=nxt, first_entries=H.gathered_entries(model, pg))
    H.train(model, pg, [4])
    out["second"], out["next2"] = incremental_dump(model, nxt, pg=pg)
    out["second_entries"] = H.gathered_entries(model, pg)
    # A threshold past one rank's clock (another host's reading) is refused on every rank: none waits in the gather.
    ahead = dict(nxt, t_cont=nxt["t_cont"] + (10**15 if dist.get_rank(pg) == 1 else 0))
    try:
        incremental_dump(model, ahead, pg=pg)
        out["ahead"] = None
    except ValueError as e:
        out["ahead"] = str(e)
    return out


def _non_blocking(pg, path):
    """A non-blocking dump after 3 steps, 2 more steps before wait(), then a
    load into a fresh model."""
    model = H.build(pg)
    H.train(model, pg, [1, 2, 3])
    out = dict(at_call=H.gathered_entries(model, pg), out_at_call=H.probe(model), dumped_ns=H.now_ns())
    handle = DynamicEmbDump(path, model, pg=pg, blocking=False)
    H.train(model, pg, [4, 5])  # training goes on while the dump is written
    out["after"] = H.gathered_entries(model, pg)
    handle.wait()
    out["done"] = handle.done()
    fresh = H.build(pg)
    DynamicEmbLoad(path, fresh, pg=pg)
    out.update(loaded_ns=H.now_ns(), loaded=H.gathered_entries(fresh, pg), loaded_out=H.probe(fresh))
    return out


def _two_ranks(rank, world, root):
    own = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes every group
    res = {"world": _round_trip(dist.GroupMember.WORLD, os.path.join(root, "w2"))}
    if rank == 0:
        res["single"] = _round_trip(own[0], os.path.join(root, "w1"))
    dist.barrier()
    res["incremental"] = _incremental(dist.GroupMember.WORLD)
    res["non_blocking"] = _non_blocking(dist.GroupMember.WORLD, os.path.join(root, "nb"))
    return res


@H.once
def two_ranks():
    """[rank 0's results, rank 1's]: round trip and continuation on the world
    of 2 ranks ("world") and on rank 0 alone ("single"), incremental dumps
    and a non-blocking dump on the world."""
    return H.run_in_scratch("dynamicemb-ckpt-", _two_ranks, 2)
