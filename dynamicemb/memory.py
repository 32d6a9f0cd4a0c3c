"""Allocation of the long-lived arrays that kernels read at random (slot
arrays, embedding rows)."""
from typing import Sequence, Union

import torch

from dynamicemb._ops import ops


def full(shape: Union[int, Sequence[int]], value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.full, with a large CPU array backed by 2 MiB pages where the
    kernel offers them (csrc/common/huge_pages_cpu.h): asked for before the
    fill first touches the pages."""
    if torch.device(device).type != "cpu":
        return torch.full(shape if isinstance(shape, (tuple, list)) else (shape,), value, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype)
    ops.advise_huge_pages(t)
    return t.fill_(value)


def zeros(shape: Union[int, Sequence[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """full(shape, 0, ...)."""
    return full(shape, 0, dtype, device)
