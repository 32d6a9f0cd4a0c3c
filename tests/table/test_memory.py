"""Allocation of the long-lived arrays (dynamicemb.memory, csrc/common/huge_pages_cpu.cpp)."""
import pytest
import torch

from dynamicemb import memory
from dynamicemb._ops import ops


@pytest.mark.parametrize("shape", [7, (3, 5), (1 << 21, 3)])  # the last: 24 MiB, advised
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.float32])
def test_zeros_are_zeros_of_the_shape_and_dtype(shape, dtype):
    t = memory.zeros(shape, dtype, torch.device("cpu"))
    want = torch.zeros(shape, dtype=dtype)
    assert t.shape == want.shape and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, want)


def test_advice_is_only_taken_for_large_tensors_and_refuses_strided_ones():
    assert ops.advise_huge_pages(torch.empty(1024)) is False  # below 4 MiB: not worth a 2 MiB page
    with pytest.raises(RuntimeError, match="contiguous CPU tensor"):
        ops.advise_huge_pages(torch.empty(64, 64).t())
    # Whether the kernel takes the advice depends on its configuration; the call must not fail.
    assert isinstance(ops.advise_huge_pages(torch.empty(1 << 22)), bool)
