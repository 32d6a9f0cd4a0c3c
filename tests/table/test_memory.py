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


def _mapping_of(ptr):
    """The (start, end) of the /proc/self/maps entry holding address ptr, or None."""
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= ptr < hi:
            return lo, hi
    return None


def test_large_arrays_get_a_2mib_aligned_mapping_of_their_own():
    # From 4 MiB on: a fresh mapping, 2 MiB-aligned (so 2 MiB pages can back
    # all of it), that lives as long as the tensor (or a view of it) and is
    # unmapped with it.
    small = ops.empty_huge([1024], torch.float32)
    assert small.shape == (1024,) and small.dtype == torch.float32
    big = ops.empty_huge([3, 1 << 20], torch.int16)  # 6 MiB
    assert big.shape == (3, 1 << 20) and big.dtype == torch.int16 and big.is_contiguous()
    ptr = big.data_ptr()
    assert ptr % (1 << 21) == 0
    lo, hi = _mapping_of(ptr)
    assert lo <= ptr and ptr + (6 << 20) <= hi
    big.fill_(7)
    view, copy = big[1], big.clone()
    del big
    assert torch.equal(view, torch.full((1 << 20,), 7, dtype=torch.int16))  # the view kept the mapping
    del view
    assert _mapping_of(ptr) != (lo, hi), "the array's mapping outlived it"
    assert torch.equal(copy, torch.full((3, 1 << 20), 7, dtype=torch.int16))


def test_large_arrays_pickle_and_copy_as_ordinary_tensors(tmp_path):
    t = memory.full((1 << 20, 2), -1, torch.int64, torch.device("cpu"))  # 16 MiB
    torch.save({"t": t}, tmp_path / "t.pt")
    back = torch.load(tmp_path / "t.pt")["t"]
    assert torch.equal(back, t) and torch.equal(t.clone(), t)
    import copy
    assert torch.equal(copy.deepcopy(t), t)
