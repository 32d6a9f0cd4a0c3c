"""positions.where_true / by_group: the tiers' bookkeeping positions, on the
CPU by our kernels (positions_where, positions_by_group), checked against
torch.nonzero and a stable sort, and their errors; their registration is
opchecked by the generated twin of every test (tests/op_checks.py)."""
import sys

import pytest
import torch

from dynamicemb._ops import ops
from dynamicemb.positions import by_group, where_true
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


@pytest.mark.parametrize("call, message", [
    (lambda: ops.positions_where(torch.tensor([1, 0])), "positions_where: mask must be Bool"),
    (lambda: ops.positions_where(torch.ones(2, 2, dtype=torch.bool)), "mask must be a contiguous 1-D tensor"),
    (lambda: ops.positions_by_group(torch.tensor([0, 2, 1]), 2), r"ids\[1\] = 2 is outside \[0, 2\)"),
    (lambda: ops.positions_by_group(torch.tensor([0, -1]), 2), r"ids\[1\] = -1 is outside \[0, 2\)"),
    (lambda: ops.positions_by_group(torch.tensor([0], dtype=torch.int32), 2), "ids must be Long"),
    (lambda: ops.positions_by_group(torch.tensor([0]), 0), "groups must be positive"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


generate_opcheck_tests(sys.modules[__name__])

