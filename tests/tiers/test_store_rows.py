"""store_gather / store_scatter: a backing store's rows at the positions its
key index gave, checked against torch's index_select / index_copy_ (the CPU
kernels; tests/cuda/test_cuda_parity_store.py runs the CUDA ones, with the
store pinned in host memory) and their errors; their registration is
opchecked by the generated twin of every test (tests/op_checks.py).
HostStore.rows_device: where a store exchanges rows with its cache."""
import sys

import pytest
import torch

from dynamicemb._ops import ops
from dynamicemb.tiers import FileStore, HostStore
from op_checks import generate_opcheck_tests, opcheck_every_call


def store_and_positions(dtype, width, rows=300, n=120, seed=0):
    g = torch.Generator().manual_seed(seed)
    store = torch.randn(rows, width, generator=g).to(dtype)
    positions = torch.randperm(rows, generator=g)[:n]
    return store, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 7, 65])
def test_gather_and_scatter_are_index_select_and_index_copy(dtype, width):
    store, positions = store_and_positions(dtype, width)
    out = torch.full((positions.numel(), width), 9.0, dtype=dtype)
    ops.store_gather(store, positions, out)
    assert torch.equal(out, store.index_select(0, positions))

    rows = torch.randn(positions.numel(), width).to(dtype)
    want = store.clone().index_copy_(0, positions, rows)
    ops.store_scatter(store, positions, rows)
    assert torch.equal(store, want)


def test_scatter_of_many_rows_in_parallel_ranges():
    """Enough rows that the CPU scatter splits them over threads (and fetches
    ahead within each range): the same as index_copy_."""
    g = torch.Generator().manual_seed(3)
    store = torch.randn(50_000, 65, generator=g)
    positions = torch.randperm(50_000, generator=g)[:20_001]
    rows = torch.randn(positions.numel(), 65, generator=g)
    want = store.clone().index_copy_(0, positions, rows)
    ops.store_scatter(store, positions, rows)
    assert torch.equal(store, want)


def test_no_positions_move_nothing():
    store, _ = store_and_positions(torch.float32, 4)
    before = store.clone()
    none = torch.zeros(0, dtype=torch.int64)
    ops.store_gather(store, none, torch.empty(0, 4))
    ops.store_scatter(store, none, torch.empty(0, 4))
    assert torch.equal(store, before)


@opcheck_every_call
def test_op_samples():
    store, positions = store_and_positions(torch.float32, 6)
    ops.store_gather(store, positions, torch.empty(positions.numel(), 6))
    ops.store_scatter(store, positions, torch.randn(positions.numel(), 6))


@pytest.mark.parametrize("bad, message", [
    (dict(positions=torch.tensor([0, 300])), r"a position is out of the store's rows \[0, 300\): 300"),
    (dict(positions=torch.tensor([-1, 2])), r"a position is out of the store's rows \[0, 300\): -1"),
    (dict(positions=torch.tensor([0, 1], dtype=torch.int32)), "positions must be a 1-D int64 CPU tensor"),
    (dict(rows=torch.zeros(2, 6, dtype=torch.float16)), "rows must be Float"),
    (dict(rows=torch.zeros(3, 6)), r"rows must be a contiguous \[2, 6\] tensor"),
    (dict(store=torch.zeros(300, 6)[:, :5]), "the store's rows must be a contiguous 2-D tensor"),
])
def test_bad_input_is_named(bad, message):
    args = dict(store=torch.zeros(300, 6), positions=torch.tensor([0, 1]), rows=torch.zeros(2, 6))
    args.update(bad)
    if "rows" in bad and bad["rows"].shape[1] != args["store"].shape[1]:
        args["store"] = torch.zeros(300, bad["rows"].shape[1])
    with pytest.raises(RuntimeError, match=message):
        ops.store_scatter(args["store"], args["positions"], args["rows"])
    with pytest.raises(RuntimeError, match="out" + message[4:] if message.startswith("rows") else message):
        ops.store_gather(args["store"], args["positions"], args["rows"])


def test_a_host_store_exchanges_rows_on_the_cpu_in_front_of_a_cpu_cache(tmp_path):
    store = HostStore()
    assert store.rows_device(torch.device("cpu")) == torch.device("cpu")
    store.open_table("t", 3, torch.float32, 1000)
    keys = torch.arange(10, 20)
    store.put("t", keys, keys[:, None].float().expand(-1, 3).contiguous(), keys)
    got = store.take_group(["t"], torch.tensor([12, 99, 15]), torch.zeros(3, dtype=torch.int64))
    at, rows, scores = got[0]
    assert at.tolist() == [0, 2] and rows.device.type == "cpu" and rows[:, 0].tolist() == [12.0, 15.0]
    assert not rows.is_pinned()
    # It holds tables for CPU caches now: a CUDA cache needs a store of its own
    # (checked before anything touches a GPU).
    with pytest.raises(ValueError, match=r"a HostStore serves caches on one device: this one holds tables \['t'\] "
                                         r"for caches on cpu, not cuda:0"):
        store.rows_device(torch.device("cuda", 0))
    assert FileStore(str(tmp_path / "f")).rows_device(torch.device("cuda", 0)) == torch.device("cpu")


generate_opcheck_tests(sys.modules[__name__])
