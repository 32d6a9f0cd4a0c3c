"""Positions that bookkeeping selects keys by (where a mask holds, grouped
by a small id such as a table) and rows written at positions. On the CPU our
kernels (csrc/common/positions_cpu.cpp: torch.nonzero mispredicts a branch
per element of a random mask; csrc/tiers/rows_cpu.cpp: index_copy_ copies on
one thread), several times faster; elsewhere torch's ops."""
from typing import List, Tuple

import torch

from dynamicemb._ops import ops


def scatter_rows(dest: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
    """dest[positions] = rows at distinct positions: on the CPU the store_scatter
    kernel (rows copied in parallel, where index_copy_ copies on one thread),
    elsewhere index_copy_."""
    if dest.device.type == "cpu" and rows.device.type == "cpu":
        ops.store_scatter(dest, positions, rows.contiguous())
    else:
        dest.index_copy_(0, positions, rows)


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
