"""emb_lookup_forward on uint8 rows, FBGEMM's fused 8-bit rowwise layout
(dim codes q, then float32 scale and bias; element = q * scale + bias): a
the serving quantizer (dynamicemb.inference.quantize_rows_int8) checked
byte for byte against FBGEMM's, the op against a float64
reference over the dequantized rows (every pooling, per-sample weights,
missing keys with a zero and a CONSTANT eval init, empty bags, dims 8 and 12
in one call), the width check; opchecked by the generated twin of every test
(tests/op_checks.py)."""
import re
import sys

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import pytest
import torch

from dynamicemb import DynamicEmbInitializerArgs, DynamicEmbInitializerMode, DynamicEmbPoolingMode, ScoredHashTable
from dynamicemb._ops import ops
from dynamicemb.inference import quantize_rows_int8
from op_checks import generate_opcheck_tests, opcheck_every_call

P = DynamicEmbPoolingMode
DIMS = [8, 12]  # 12: not a multiple of 8 (a vector tail, unaligned scale and bias)
CAPACITY, BUCKET = 128, 16
MISSING = 10_000  # keys from here on are never stored


def quantize(x: torch.Tensor) -> torch.Tensor:
    """The product's quantizer (checked against FBGEMM's below)."""
    return quantize_rows_int8(x)


def dequantize(w: torch.Tensor) -> torch.Tensor:
    """float32 rows: q * scale, then + bias (two roundings, as the kernels)."""
    d = w.shape[1] - 8
    sb = w[:, d:].contiguous().view(torch.float32)
    return w[:, :d].float() * sb[:, :1] + sb[:, 1:]


@pytest.mark.parametrize("dim", [8, 12, 64])
def test_quantizer_matches_fbgemm(dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(8192, dim, generator=g) * torch.rand(8192, 1, generator=g) * 10
    x[0] = 0.5  # a constant row: scale 0, every code 0
    want = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(x)
    assert torch.equal(quantize(x), want)
    # The textbook order, (x - min) * 255 / (range + eps), rounds some
    # products near .5 the other way: at most one code off.
    mn = x.min(1, keepdim=True).values
    rng = x.max(1, keepdim=True).values - mn
    q = torch.round((x - mn) * 255 / (rng + 1e-8)).clamp(0, 255)
    assert (q - want[:, :dim].float()).abs().max() <= 1


def _init_params(values):
    """CONSTANT eval init per table (0.0: the zero init)."""
    args = [DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=v) for v in values]
    return torch.tensor([a.packed(None, t) for t, a in enumerate(args)], dtype=torch.float64)


def _tables(device):
    """Two logical tables in one hash table, 60 keys inserted into each; their
    quantized rows (one per slot) and the keys stored."""
    g = torch.Generator().manual_seed(1)
    ht = ScoredHashTable(CAPACITY, bucket_capacity=BUCKET, num_tables=len(DIMS), device=device)
    stored = []
    for t in range(len(DIMS)):
        keys = torch.randperm(1000, generator=g)[:60].to(device)
        ht.insert(keys, t)
        stored.append(keys[ht.lookup(keys, t)[1]].cpu())
    weights = [quantize(torch.randn(CAPACITY, d, generator=g) * torch.rand(CAPACITY, 1, generator=g) * 4 + 1)
               for d in DIMS]
    return ht, [w.to(device) for w in weights], stored


def _batch(stored, feature_table, batch, gen, device):
    """Bags of 0..6 keys (bag 1 of every feature empty), about 3 in 4 stored."""
    lengths = torch.randint(0, 7, (len(feature_table) * batch,), generator=gen)
    lengths[1::batch] = 0
    parts = []
    for j, n in enumerate(lengths.tolist()):
        keys = stored[feature_table[j // batch]]
        hit = keys[torch.randint(0, len(keys), (n,), generator=gen)]
        miss = torch.randint(MISSING, 2 * MISSING, (n,), generator=gen)
        parts.append(torch.where(torch.rand(n, generator=gen) < 0.75, hit, miss))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return torch.cat(parts).to(device), offsets.to(device)


def _op_args(ht, weights, idx, off, feature_table, psw, pooling, init_values):
    return ([ht.slot_keys], [ht.slot_digests], [ht.table_buckets], [ht.bucket_capacity], [0] * len(DIMS),
            list(range(len(DIMS))), weights, idx, off, feature_table, DIMS, psw, int(pooling),
            _init_params(init_values), 0, torch.float32)


def _reference(ht, weights, idx, off, feature_table, psw, pooling, init_values):
    """float64 pooling of the dequantized rows (missing keys: their init value)."""
    off = off.cpu().tolist()
    B = (len(off) - 1) // len(feature_table)
    vals = []  # per feature: the float32 value rows of its indices, as float64
    for f, t in enumerate(feature_table):
        keys = idx[off[f * B]:off[(f + 1) * B]]
        slots, found = (x.cpu() for x in ht.lookup(keys, t))
        rows = dequantize(weights[t].cpu())[(slots - ht.table_slot_range(t)[0]).clamp(min=0)]
        rows[~found] = init_values[t]
        vals.append(rows.double())
    if pooling == P.NONE:
        return torch.cat(vals)
    w = torch.ones(idx.numel(), dtype=torch.float64) if psw is None else psw.cpu().double()
    out = []
    for b in range(B):
        cols = []
        for f in range(len(feature_table)):
            j = f * B + b
            lo, hi = off[j] - off[f * B], off[j + 1] - off[f * B]
            acc = (vals[f][lo:hi] * w[off[j]:off[j + 1], None]).sum(0)
            cols.append(acc / (hi - lo) if pooling == P.MEAN and hi > lo else acc)
        out.append(torch.cat(cols))
    return torch.stack(out)


INITS = [(0.0, 0.0), (0.25, -1.5)]


@pytest.mark.parametrize("init_values", INITS, ids=["zero_init", "constant_init"])
@pytest.mark.parametrize("pooling,weighted,feature_table", [
    (P.SUM, False, [0, 1, 1]),
    (P.MEAN, False, [1, 0, 1]),
    (P.SUM, True, [0, 1, 0]),
    (P.NONE, False, [1, 1]),
    (P.NONE, False, [0]),
], ids=["sum", "mean", "weighted_sum", "none_dim12", "none_dim8"])
def test_pooled_equals_float64_reference(device, pooling, weighted, feature_table, init_values):
    ht, weights, stored = _tables(device)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        idx, off = _batch(stored, feature_table, 5, gen, device)
        psw = (torch.rand(idx.numel(), generator=gen) * 2 - 0.5).to(device) if weighted else None
        got = ops.emb_lookup_forward(*_op_args(ht, weights, idx, off, feature_table, psw, pooling, init_values))
        want = _reference(ht, weights, idx, off, feature_table, psw, pooling, init_values)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max()))


def test_all_missing_and_empty(device):
    ht, weights, _ = _tables(device)
    idx = torch.tensor([MISSING, MISSING + 1, MISSING + 2], device=device)
    off = torch.tensor([0, 0, 2, 2, 3], device=device)  # features [0, 1] x 2 bags, two empty
    got = ops.emb_lookup_forward(*_op_args(ht, weights, idx, off, [0, 1], None, P.SUM, INITS[1])).cpu()
    assert torch.equal(got, torch.tensor([[0.0] * 20, [0.5] * 8 + [-1.5] * 12]))  # init 0.25 twice, -1.5 once


@pytest.mark.parametrize("width", [8 + 12 - 4, 8 + 12 + 4])
def test_rejects_wrong_width(device, width):
    ht, weights, _ = _tables(device)
    weights[1] = torch.zeros(CAPACITY, width, dtype=torch.uint8, device=device)
    idx, off = torch.tensor([1, 2], device=device), torch.tensor([0, 1, 2], device=device)
    msg = (f"dynamicemb: table 1: uint8 rows must be dim + 8 = 20 bytes wide "
           f"(codes, then float32 scale and bias), got {width}")
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        ops.emb_lookup_forward(*_op_args(ht, weights, idx, off, [0, 1], None, P.SUM, INITS[0]))


def test_training_forward_refuses_uint8(device):
    """Only the eval lookup reads uint8 rows; emb_forward keeps refusing them."""
    _, weights, _ = _tables(device)
    rows = torch.tensor([0, 1], device=device)
    with pytest.raises(RuntimeError, match="not implemented for 'Byte'"):
        ops.emb_forward(weights, rows, rows, rows, torch.tensor([0, 1, 2], device=device), [0, 1], DIMS, None,
                        int(P.SUM), _init_params(INITS[0]), 0, torch.float32)


@opcheck_every_call
@pytest.mark.parametrize("pooling", list(P), ids=lambda p: p.name)
def test_op_samples(pooling):
    ht, weights, stored = _tables("cpu")
    feature_table = [1, 1] if pooling == P.NONE else [0, 1]
    idx, off = _batch(stored, feature_table, 3, torch.Generator().manual_seed(3), "cpu")
    psw = None if pooling == P.NONE else torch.rand(idx.numel())
    ops.emb_lookup_forward(*_op_args(ht, weights, idx, off, feature_table, psw, pooling, INITS[1]))


generate_opcheck_tests(sys.modules[__name__])
