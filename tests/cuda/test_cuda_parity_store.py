"""A backing store's rows on the device under test: store_gather and
store_scatter with the store in pinned host memory (read and written in
place by the kernels) or on the device, against the CPU kernels; and a
HostStore in front of a cache on that device (its rows pinned, exchanged on
the device) against the same calls on a CPU HostStore, bit for bit. Skipped
without a GPU; DYNAMICEMB_PARITY_DEVICE=cpu runs them CPU against CPU
(cuda_parity.py)."""
import pytest
import torch

from cuda_parity import DEV, PARITY_MARKS, same
from dynamicemb._ops import ops
from dynamicemb.tiers import HostStore

pytestmark = PARITY_MARKS


def host_rows(t):
    """t where a CUDA kernel reads it in place: pinned host memory (on the CPU: as is)."""
    return t.pin_memory() if DEV == "cuda" else t.clone()


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("dtype, width", [(torch.float32, 65), (torch.float16, 7), (torch.bfloat16, 8),
                                          (torch.float32, 1), (torch.float16, 3)])  # words of 16 bytes down to 2
def test_gather_and_scatter_match_the_cpu(where, dtype, width):
    g = torch.Generator().manual_seed(width)
    ref = torch.randn(500, width, generator=g).to(dtype)
    got = host_rows(ref) if where == "host" else ref.to(DEV)
    positions = torch.randperm(500, generator=g)[:333]

    out_ref = torch.empty(333, width, dtype=dtype)
    out_got = torch.empty(333, width, dtype=dtype, device=DEV)
    ops.store_gather(ref, positions, out_ref)
    ops.store_gather(got, positions, out_got)
    same(out_ref, out_got)

    rows = torch.randn(333, width, generator=g).to(dtype)
    ops.store_scatter(ref, positions, rows)
    ops.store_scatter(got, positions, rows.to(DEV))
    if DEV == "cuda":
        torch.cuda.synchronize()
    same(ref, got)


def test_a_pageable_store_is_refused_by_a_device_kernel():
    if DEV != "cuda":
        pytest.skip("the CPU reads any host memory")
    with pytest.raises(RuntimeError, match=r"the store's rows must be on cuda:0 \(the device of out\) or in pinned "
                                           r"host memory, got cpu \(not pinned\)"):
        ops.store_gather(torch.zeros(10, 4), torch.tensor([1]), torch.empty(1, 4, device=DEV))


def test_a_host_store_in_front_of_a_device_cache_matches_a_cpu_one():
    """The calls a cache makes (put_group of evicted rows, take_group of
    missing keys, growth past the reserved rows), then reads (items, read)."""
    ref, got = HostStore(bucket_capacity=128), HostStore(bucket_capacity=128)
    dev = got.rows_device(torch.device(DEV))
    assert ref.rows_device(torch.device("cpu")) == torch.device("cpu") and dev.type == DEV
    for s in (ref, got):
        s.open_table("a", 9, torch.float32, 1 << 14)
        s.open_table("b", 4, torch.float32, 1 << 14)
        s.reserve("a", 256)
    assert got._rows["a"].is_pinned() == (DEV == "cuda") and got._rows["a"].device.type == "cpu"
    g = torch.Generator().manual_seed(0)
    names = ["a", "b"]
    for step in range(12):
        keys = torch.randint(0, 3000, (400,), generator=g).unique()
        tids = (keys % 2).to(torch.int64)
        taken = [s.take_group(names, keys, tids) for s in (ref, got)]
        assert taken[0].keys() == taken[1].keys()
        for j in taken[0]:
            (at0, r0, s0), (at1, r1, s1) = taken[0][j], taken[1][j]
            assert torch.equal(at0, at1) and torch.equal(s0, s1) and r1.device == dev
            same(r0, r1)
        parts = {}
        for j, w in ((0, 9), (1, 4)):  # every key goes back, trained (its rows changed)
            k = keys[tids == j]
            parts[j] = (k, torch.randn(k.numel(), w, generator=g), k * 7 + step)
        lost = [s.put_group(names, {j: (k, r.to(d), sc) for j, (k, r, sc) in parts.items()})
                for s, d in ((ref, "cpu"), (got, dev))]
        assert lost[0] == lost[1]
    assert got._rows["a"].shape[0] > 256  # grew past its reserve: the rows moved into new pinned memory
    for name in names:
        (k0, r0, s0), (k1, r1, s1) = next(ref.items(name, 1 << 20)), next(got.items(name, 1 << 20))
        o0, o1 = k0.argsort(), k1.argsort()
        assert torch.equal(k0[o0], k1[o1]) and torch.equal(s0[o0], s1[o1])
        same(r0[o0], r1[o1])
        f0, rr0, _ = ref.read(name, k0[o0][:50])
        f1, rr1, _ = got.read(name, k0[o0][:50])
        assert bool(f0.all()) and bool(f1.all())
        same(rr0, rr1)
