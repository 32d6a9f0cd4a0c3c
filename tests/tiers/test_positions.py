"""positions.where_true / by_group: the tiers' bookkeeping positions, on the
CPU by our kernels (positions_where, positions_by_group), checked against
torch.nonzero and a stable sort, and their errors; their registration is
opchecked by the generated twin of every test (tests/op_checks.py)."""
import sys

import pytest
import torch

from dynamicemb._ops import ops
from dynamicemb.positions import count_where, by_group, where_true
from op_checks import generate_opcheck_tests, opcheck_every_call


@pytest.mark.parametrize("n", [0, 1, 7, 4096, 70_001])  # 70_001: several chunks (threads) with a ragged end
@pytest.mark.parametrize("share", [0.0, 0.01, 0.5, 1.0])
def test_where_true_is_nonzero(n, share):
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < share
    assert torch.equal(where_true(mask), mask.nonzero().squeeze(1))


def test_where_true_with_true_entries_only_at_chunk_ends():
    """A chunk whose last true entry is its last element, and chunks with none."""
    mask = torch.zeros(100_000, dtype=torch.bool)
    mask[[0, 49_999, 50_000, 99_999]] = True
    assert where_true(mask).tolist() == [0, 49_999, 50_000, 99_999]


@pytest.mark.parametrize("n", [0, 1, 1000, 70_001])
@pytest.mark.parametrize("groups", [1, 2, 5])
def test_by_group_is_a_stable_sort(n, groups):
    ids = torch.randint(0, groups, (n,), generator=torch.Generator().manual_seed(n + groups))
    order, counts = by_group(ids, groups)
    assert torch.equal(order, torch.sort(ids, stable=True).indices)
    assert counts == torch.bincount(ids, minlength=groups).tolist()


def test_by_group_counts_absent_groups():
    order, counts = by_group(torch.tensor([3, 0, 3]), 5)
    assert order.tolist() == [1, 0, 2] and counts == [1, 0, 0, 2, 0]


@opcheck_every_call
def test_op_samples():
    mask, ids = torch.tensor([True, False, True]), torch.tensor([1, 0, 1])
    assert torch.equal(ops.positions_where(mask), mask.nonzero().squeeze(1))
    order, counts = ops.positions_by_group(ids, 2)
    assert torch.equal(order, torch.sort(ids, stable=True).indices)
    assert torch.equal(counts, torch.bincount(ids, minlength=2))
    assert torch.equal(ops.positions_count(ids, mask, 3), torch.bincount(ids[mask], minlength=3))


@pytest.mark.parametrize("call, message", [
    (lambda: ops.positions_where(torch.tensor([1, 0])), "positions_where: mask must be Bool"),
    (lambda: ops.positions_where(torch.ones(2, 2, dtype=torch.bool)), "mask must be a contiguous 1-D tensor"),
    (lambda: ops.positions_by_group(torch.tensor([0, 2, 1]), 2), r"ids\[1\] = 2 is outside \[0, 2\)"),
    (lambda: ops.positions_by_group(torch.tensor([0, -1]), 2), r"ids\[1\] = -1 is outside \[0, 2\)"),
    (lambda: ops.positions_by_group(torch.tensor([0], dtype=torch.int32), 2), "ids must be Long"),
    (lambda: ops.positions_by_group(torch.tensor([0]), 0), "groups must be positive"),
    (lambda: ops.positions_count(torch.tensor([0, 3]), torch.tensor([False, True]), 3),
     r"positions_count: ids\[1\] = 3 is outside \[0, 3\)"),
    (lambda: ops.positions_count(torch.tensor([0, 1]), torch.tensor([True]), 3), "ids has 2 entries, mask 1"),
    (lambda: ops.positions_count(torch.tensor([0]), torch.tensor([1]), 3), "positions_count: mask must be Bool"),
    (lambda: ops.positions_count(torch.tensor([0]), torch.tensor([True]), 0), "groups must be positive"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


generate_opcheck_tests(sys.modules[__name__])


def test_count_where_counts_the_masked_positions_per_group(device):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 5, (1000,), generator=g)
    mask = torch.rand(1000, generator=g) < 0.3
    want = [sum(1 for i, m in zip(ids.tolist(), mask.tolist()) if m and i == k) for k in range(7)]
    got = count_where(ids.to(device), mask.to(device), 7)
    assert got.dtype == torch.int64 and got.device.type == device and got.tolist() == want
    assert count_where(ids[:0].to(device), mask[:0].to(device), 3).tolist() == [0, 0, 0]
