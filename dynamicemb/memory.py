"""Allocation of the long-lived arrays that kernels read at random (slot
arrays, embedding rows)."""
from typing import Sequence, Union

import torch

from dynamicemb._ops import ops


def zeros(shape: Union[int, Sequence[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, with a large CPU array backed by 2 MiB pages where the
    kernel offers them (csrc/common/huge_pages_cpu.h): asked for before the
    zero fill first touches the pages."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype)
    ops.advise_huge_pages(t)
    return t.zero_()
