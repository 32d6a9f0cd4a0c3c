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


def _rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_large_arrays_get_a_2mib_aligned_mapping_of_their_own():
    # From 4 MiB on: a fresh 2 MiB-aligned mapping (so 2 MiB pages can back
    # all of it), the array a few 64-byte lines in (a different offset for
    # each array), that lives as long as the tensor or a view of it.
    small = ops.empty_huge([1024], torch.float32, True)
    assert small.shape == (1024,) and small.dtype == torch.float32
    arrays = [ops.empty_huge([3, 1 << 20], torch.int16, True) for _ in range(3)]  # 6 MiB each
    for a in arrays:
        assert a.shape == (3, 1 << 20) and a.dtype == torch.int16 and a.is_contiguous()
    offsets = [a.data_ptr() % (1 << 21) for a in arrays]
    assert all(o % 64 == 0 and o < (128 << 10) for o in offsets) and len(set(offsets)) == 3
    big = ops.empty_huge([8 << 20], torch.int64, True)  # 64 MiB
    before = _rss_mib()
    big.fill_(7)
    assert _rss_mib() - before > 60
    view, copy = big[1 << 20:], big[:16].clone()
    del big
    assert bool((view == 7).all())  # the view kept the mapping
    filled = _rss_mib()
    del view
    assert filled - _rss_mib() > 60  # gone with the last view
    assert torch.equal(copy, torch.full((16,), 7, dtype=torch.int64))


@pytest.mark.parametrize("own_mapping", [False, True])
def test_large_arrays_pickle_and_copy_as_ordinary_tensors(tmp_path, own_mapping):
    t = memory.full((1 << 20, 2), -1, torch.int64, torch.device("cpu"), own_mapping)  # 16 MiB
    torch.save({"t": t}, tmp_path / "t.pt")
    back = torch.load(tmp_path / "t.pt")["t"]
    assert torch.equal(back, t) and torch.equal(t.clone(), t)
    import copy
    assert torch.equal(copy.deepcopy(t), t)
