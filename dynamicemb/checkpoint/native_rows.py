"""A native TorchRec table's weight, given to load_state_dict() for a table
that is now dynamic: key i gets row i (a static table's id is its row), so
a model moved to dynamic tables keeps what its static tables learned.

The weight comes as the native model's state_dict() holds it after
dcp.load: a ShardedTensor (each rank its shards, whole rows: TABLE_WISE or
ROW_WISE), or a plain tensor of every row given on every rank (an unsharded
model's, or dcp_to_torch_save's file), of which each rank takes rows
i % world == rank. The rows then go the way of a state dict's slots
(dynamicemb.checkpoint.state_dict): each to the rank that owns its key,
replacing the table's content. Optimizer state starts fresh (FBGEMM keeps
it in model.fused_optimizer, not in the weight), and every key scores as if
accessed at the load.
"""
from typing import List

import torch

from dynamicemb import rules
from dynamicemb.checkpoint.format import CheckpointError

WEIGHT = "weight"  # <collection>.<table>.weight, a native table's entry


def _local_rows(name: str, weight, dim: int, rank: int, world: int):
    """(keys, rows, cover) of this rank: cover says which rows of the whole
    weight they are, for the ranks to check together that every row is
    taken once (check_cover)."""
    where = f"table {name!r}: its native weight given to load_state_dict"
    shards = getattr(weight, "local_shards", None)
    if shards is not None:  # a ShardedTensor
        n, cols = weight.size()
        keys, rows, ranges = [], [], []
        for s in shards():
            (r0, c0), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
            if c0 != 0 or nc != cols:
                raise CheckpointError(f"{where} is split by columns (a shard of columns {c0}..{c0 + nc} of {cols}): "
                                      f"a dynamic table takes whole rows; load it whole (dcp_to_torch_save, "
                                      f"torch.load) or from a TABLE_WISE / ROW_WISE model")
            keys.append(torch.arange(r0, r0 + nr, dtype=torch.int64))
            rows.append(s.tensor.reshape(nr, nc))
            ranges.append((r0, r0 + nr))
        cover = {"rows": n, "ranges": ranges}
    elif type(weight) is torch.Tensor or type(weight) is torch.nn.Parameter:  # not a subclass: a DTensor is local
        if weight.dim() != 2:
            raise CheckpointError(f"{where} has shape {tuple(weight.shape)}, not [rows, dim]")
        n, cols = weight.shape
        keys = [torch.arange(rank, n, world, dtype=torch.int64)]
        rows = [weight.detach()[keys[0]]]
        cover = {"rows": n, "whole": True}
    else:
        raise CheckpointError(f"{where} is a {type(weight).__name__}: it takes a ShardedTensor (a sharded native "
                              f"model's state_dict()) or a tensor of every row on every rank")
    if cols != dim:
        raise CheckpointError(f"{where} has rows of {cols} values; the dynamic table's dim is {dim}")
    return keys, [r.cpu() for r in rows], cover


def weight_rows(name: str, ref, weight, template: dict, rank: int, world: int) -> dict:
    """A native weight as _rows_of gives a state dict's slots: this rank's
    cover, the model's own step, optimizer step and custom score (a weight
    carries none), and the columns of `template` (the model's empty ones)
    with the rows appended."""
    keys, rows, cover = _local_rows(name, weight, ref.options.dim, rank, world)
    strategy, m, t = ref.storage.strategy(ref.index), ref.module, ref.index
    cols = {c: [v] for c, v in template.items()}
    state = cols["optimizer_state"][0]
    if rules.score_is_clock(strategy) or rules.counts_accesses(strategy):
        score = 0  # an age of 0 (read now), or no access counted yet
    else:
        score = m.step if rules.scored_by_step(strategy) else ref.storage.custom_scores[t]
    for k, r in zip(keys, rows):
        n = k.numel()
        cols["keys"].append(k)
        cols["values"].append(r.to(cols["values"][0].dtype))
        cols["optimizer_state"].append(torch.zeros((n,) + tuple(state.shape[1:]), dtype=state.dtype))
        cols["scores"].append(torch.full((n,), score, dtype=torch.int64))
        if "timestamps" in cols:
            cols["timestamps"].append(torch.zeros(n, dtype=torch.int64))  # ages: accessed now
    meta = {"step": m.step, "optimizer_step": m.optimizer_step, "custom_score": ref.storage.custom_scores[t]}
    return {"slots": cover, "meta": meta, "cols": cols}


def check_cover(name: str, covers: List[dict], world: int) -> None:
    """The ranks' covers of one table's native weight take every row once:
    all of them the whole weight (each a share), or shards that tile it."""
    where = f"table {name!r}: the native weight given to load_state_dict"
    if len(covers) != world:
        raise CheckpointError(f"{where} reached {len(covers)} of {world} ranks; give it on every rank (the state "
                              f"dict of the native model on each)")
    sizes = sorted({c["rows"] for c in covers})
    if len(sizes) != 1:
        raise CheckpointError(f"{where} has {sizes} rows on different ranks")
    wholes = [c.get("whole", False) for c in covers]
    if any(wholes) and not all(wholes):
        raise CheckpointError(f"{where} is whole on some ranks and sharded on others")
    if all(wholes):
        return
    at = 0
    for lo, hi in sorted(r for c in covers for r in c["ranges"]):
        if lo != at:
            raise CheckpointError(f"{where}: its shards {'overlap' if lo < at else 'leave a gap'} at row "
                                  f"{min(lo, at)} of {sizes[0]}")
        at = hi
    if at != sizes[0]:
        raise CheckpointError(f"{where}: its shards end at row {at} of {sizes[0]}")
