"""Positions that bookkeeping selects keys by: where a mask holds, and
grouped by a small id (a table). On the CPU our kernels
(csrc/common/positions_cpu.cpp: torch.nonzero mispredicts a branch per
element of a random mask, several times slower); elsewhere torch's ops."""
from typing import List, Tuple

import torch

from dynamicemb._ops import ops


def where_true(mask: torch.Tensor) -> torch.Tensor:
    """Ascending int64 positions of mask's true entries (1-D bool)."""
    if mask.device.type == "cpu":
        return ops.positions_where(mask.contiguous())
    return mask.nonzero().squeeze(1)


def by_group(ids: torch.Tensor, groups: int) -> Tuple[torch.Tensor, List[int]]:
    """(positions grouped by ids in [0, groups), ascending within a group;
    each group's count): group g's positions are order[sum(counts[:g]):][:counts[g]]."""
    if ids.device.type == "cpu":
        order, counts = ops.positions_by_group(ids.contiguous(), groups)
    else:
        order = torch.sort(ids, stable=True).indices
        counts = torch.bincount(ids, minlength=groups)
    return order, counts.tolist()
