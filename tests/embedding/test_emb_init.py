"""Initial values: a pure function of (seed, table stream, key), whatever the
batch, its order or the module instance; each initializer's distribution."""
import math

import pytest
import torch

from dynamicemb import (
    DynamicEmbCheckMode,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbPoolingMode,
)
from emb_helpers import debug_rows, make_module, stored

Mode = DynamicEmbInitializerMode
NONE = DynamicEmbPoolingMode.NONE


def _module(num_tables=2, dim=8, seed=0, init=None, streams=None, **kw):
    kw.setdefault("max_capacity", 8192)
    if init is not None:
        kw["initializer_args"] = init
    return make_module([dim] * num_tables, pooling=NONE, module_kwargs=dict(seed=seed, init_streams=streams), **kw)


def _initial(m, keys, table=0):
    """Rows of (fresh) keys of `table` from a training forward (no update):
    one batch of one bag per feature, all keys in the bag of feature `table`."""
    keys = torch.as_tensor(keys, dtype=torch.int64)
    offsets = torch.tensor([0] * (table + 1) + [keys.numel()] * (m.num_tables - table))
    return m(keys, offsets).detach()


def test_initial_row_independent_of_batch_order_and_instance():
    gen = torch.Generator().manual_seed(0)
    keys = torch.cat([torch.randint(-2**62, 2**62, (3000,), generator=gen), torch.tensor([-1, 0, 2**63 - 1])])
    big = dict(max_capacity=1 << 16)  # room for every key: no eviction
    a = _module(**big)
    ref = _initial(a, keys, table=1)
    # Another instance, keys in another order, in other batches (one big
    # enough for the parallel unique path), with other keys around them.
    b = _module(**big)
    perm = torch.randperm(keys.numel(), generator=gen)
    noise = torch.randint(0, 1000, (5000,), generator=gen)
    first = torch.cat([keys[perm[:1500]], noise])
    got = torch.empty_like(ref)
    got[perm[:1500]] = _initial(b, first, table=1)[:1500]
    got[perm[1500:]] = _initial(b, keys[perm[1500:]], table=1)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    # The stored rows are the same values.
    found, rows = stored(b, 1, keys)
    assert bool(found.all())
    torch.testing.assert_close(rows[:, :8], ref, atol=0, rtol=0)
    # Another table's stream or another seed give other rows.
    assert not torch.equal(_initial(_module(**big), keys, table=0), ref)
    assert not torch.equal(_initial(_module(seed=1, **big), keys, table=1), ref)
    # The stream, not the position, names the table: table 1 of `a` moved
    # to position 0 of a one-table module keeps its rows.
    torch.testing.assert_close(_initial(_module(num_tables=1, streams=[1], **big), keys, table=0), ref, atol=0, rtol=0)


def test_failed_keys_read_the_same_initial_value_as_stored_ones():
    keys = torch.arange(1000, 1020)
    tiny = make_module([8], pooling=NONE, max_capacity=16, bucket_capacity=16,
                       safe_check_mode=DynamicEmbCheckMode.IGNORE)
    out = tiny(keys, torch.tensor([0, 20])).detach()
    assert tiny.table_stats()["t0"]["failed"] == 4
    # The same bounds need the same num_embeddings: the default is max_capacity.
    big = make_module([8], pooling=NONE, max_capacity=8192, num_embeddings=16)
    torch.testing.assert_close(out, _initial(big, keys, table=0), atol=0, rtol=0)


def _values(init, n=2000, dim=16, **kw):
    return _initial(_module(num_tables=1, dim=dim, init=init, **kw), torch.arange(n) * 7919 - 5000).flatten()


def test_uniform_default_bounds():
    v = _values(DynamicEmbInitializerArgs(), num_embeddings=100)  # bound sqrt(1/100)
    assert v.min() >= -0.1 and v.max() <= 0.1
    assert v.min() < -0.099 and v.max() > 0.099
    assert abs(float(v.mean())) < 0.002
    assert abs(float(v.std()) - 0.2 / math.sqrt(12)) < 0.002
    # num_embeddings unset: sqrt(1 / max_capacity).
    v = _values(DynamicEmbInitializerArgs(mode=Mode.UNIFORM), max_capacity=4096)
    assert v.abs().max() <= 1 / 64 and v.abs().max() > 0.99 / 64
    v = _values(DynamicEmbInitializerArgs(mode=Mode.UNIFORM, lower=0.5, upper=0.75))
    assert v.min() >= 0.5 and v.max() <= 0.75 and abs(float(v.mean()) - 0.625) < 0.003


def test_normal_statistics():
    v = _values(DynamicEmbInitializerArgs(mode=Mode.NORMAL, mean=0.5, std_dev=2.0))
    assert abs(float(v.mean()) - 0.5) < 0.05
    assert abs(float(v.std()) - 2.0) < 0.05
    assert float((v - 0.5).abs().max()) > 6.0  # tails exist: not truncated


def test_truncated_normal_statistics():
    v = _values(DynamicEmbInitializerArgs(mode=Mode.TRUNCATED_NORMAL, mean=1.0, std_dev=0.5))
    assert v.min() >= 0.0 and v.max() <= 2.0  # default bounds mean ± 2 std_dev
    assert abs(float(v.mean()) - 1.0) < 0.01
    # std of a normal truncated at ±2 sigma: 0.8796 sigma.
    assert abs(float(v.std()) - 0.8796 * 0.5) < 0.01
    v = _values(DynamicEmbInitializerArgs(mode=Mode.TRUNCATED_NORMAL, std_dev=1.0, lower=-0.5, upper=1.0))
    assert v.min() >= -0.5 and v.max() <= 1.0 and v.min() < -0.49 and v.max() > 0.99


def test_constant():
    v = _values(DynamicEmbInitializerArgs(mode=Mode.CONSTANT, value=0.25), n=50)
    assert torch.equal(v, torch.full_like(v, 0.25))


def test_debug_formula():
    keys = [-1, 0, 5, 123456, -100001, 2**63 - 1, -2**63]
    m = _module(num_tables=1, dim=6, init=DynamicEmbInitializerArgs(mode=Mode.DEBUG))
    torch.testing.assert_close(_initial(m, keys), debug_rows(keys, 6), atol=0, rtol=0)


def test_bad_bounds_rejected():
    with pytest.raises(ValueError, match="lower bound 1.0 exceeds upper bound 0.0"):
        _module(init=DynamicEmbInitializerArgs(mode=Mode.UNIFORM, lower=1.0, upper=0.0))


# ---- the generator against an independent Python model ------------------------------------

_M32 = 0xFFFFFFFF


def _philox4x32_10(seed: int, table: int, key: int, block: int):
    """Philox4x32-10 (Salmon et al. 2011) on the counter (key lo, key hi,
    table, block) with key (seed lo, seed hi): init_rules.h's stream."""
    k = key & (2**64 - 1)
    c = [k & _M32, k >> 32, table & _M32, block & _M32]
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & _M32, (p0 >> 32) ^ c[3] ^ k1, p0 & _M32]
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c


def _reference_rows(mode, keys, dim, seed, stream, lo, hi, mean, std):
    """Element j of a key's row: UNIFORM takes output j of the stream
    (block j // 4), NORMAL Box-Muller on outputs 2j, 2j + 1, each output u
    mapped to (u + 0.5) / 2^32; arithmetic in float64, rounded to float32."""
    out = []
    for key in keys:
        row = []
        for j in range(dim):
            if mode == "UNIFORM":
                u = _philox4x32_10(seed, stream, key, j // 4)[j % 4]
                row.append(lo + (hi - lo) * ((u + 0.5) * 2.0**-32))
            else:
                blk = _philox4x32_10(seed, stream, key, j // 2)
                u1, u2 = ((blk[2 * (j % 2)] + 0.5) * 2.0**-32, (blk[2 * (j % 2) + 1] + 0.5) * 2.0**-32)
                row.append(mean + std * math.sqrt(-2.0 * math.log(u1)) * math.cos(2 * math.pi * u2))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).to(torch.float32)


@pytest.mark.parametrize("dim", [1, 5, 16, 63, 64, 70, 130])  # >= 64 / 32 blocks: the 16-block (AVX-512 / AVX2) path too
@pytest.mark.parametrize("mode", ["UNIFORM", "NORMAL"])
def test_initial_rows_match_a_python_philox_model(mode, dim):
    from dynamicemb._ops import ops

    keys = [0, 1, -1, 2**63 - 1, -(2**63), 123456789012345, -987654321]
    seed, stream, lo, hi, mean, std = 0x1234_5678_9ABC_DEF0, 5, -0.3, 0.7, 0.25, 1.5
    args = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode[mode], lower=lo, upper=hi, mean=mean, std_dev=std)
    params = torch.tensor([args.packed(1000, stream)], dtype=torch.float64)
    w = torch.full((len(keys), dim + 3), 7.0)
    ops.emb_init_rows([w], torch.arange(len(keys)), torch.zeros(len(keys), dtype=torch.int64),
                      torch.tensor(keys), [dim], params, seed)
    want = _reference_rows(mode, keys, dim, seed, stream, lo, hi, mean, std)
    if mode == "UNIFORM":  # exact operations only: bit for bit
        assert torch.equal(w[:, :dim], want)
    else:  # our own log / cos agree with libm's to ~1 ulp of a double
        torch.testing.assert_close(w[:, :dim], want, rtol=0, atol=1e-6)
    assert bool((w[:, dim:] == 0).all())  # the optimizer state starts at zero


@pytest.mark.parametrize("dims,state", [((64, 64), 0), ((64, 128), 0), ((128, 64), 8), ((64, 64), 5)])
def test_streamed_initial_rows_match_a_python_philox_model(dims, state):
    """float32 UNIFORM rows in the layout the init streams out of registers
    (dim a multiple of 64, stride of 8; two rows at a time with AVX-512),
    the tables' rows interleaved so that pairs mix tables, bounds and dims,
    an odd count left over; against the Python Philox, bit for bit, with the
    optimizer state zeroed. state 5 (stride not a multiple of 8) takes the
    buffered path."""
    from dynamicemb._ops import ops

    keys = [0, 1, -1, 2**63 - 1, -(2**63), 123456789012345, -987654321, 42, 7]
    seed, streams, bounds = 0x0FED_CBA9_8765_4321, (3, 11), ((-0.3, 0.7), (-0.05, 0.05))
    params = torch.tensor([DynamicEmbInitializerArgs(mode=Mode.UNIFORM, lower=lo, upper=hi).packed(1000, st)
                           for (lo, hi), st in zip(bounds, streams)], dtype=torch.float64)
    n = len(keys)
    weights = [torch.full((n, d + state), 7.0) for d in dims]
    tids = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 0])
    rows = torch.tensor([4, 0, 8, 1, 3, 7, 2, 5, 0])
    ops.emb_init_rows(weights, rows, tids, torch.tensor(keys), list(dims), params, seed)
    for t in range(2):
        sel = (tids == t).nonzero().squeeze(1)
        want = _reference_rows("UNIFORM", [keys[i] for i in sel], dims[t], seed, streams[t], *bounds[t], 0.0, 1.0)
        assert torch.equal(weights[t][rows[sel], :dims[t]], want)
        assert bool((weights[t][rows[sel], dims[t]:] == 0).all())
        untouched = torch.ones(n, dtype=torch.bool)
        untouched[rows[sel]] = False
        assert bool((weights[t][untouched] == 7.0).all())


@pytest.mark.parametrize("dim", [1, 3, 4, 63, 64, 65, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stored_initial_rows_match_the_scalar_rule(dim, dtype):
    """emb_init_rows (vectorized UNIFORM path) against emb_forward's value for
    keys without a row (the scalar init::fill_row), bit for bit, with the
    optimizer state zeroed; any dim, not only multiples of the block width."""
    from dynamicemb._ops import ops
    init = DynamicEmbInitializerArgs(mode=Mode.UNIFORM, lower=-0.3, upper=0.7)
    m = make_module([dim, dim], pooling=NONE, max_capacity=64, bucket_capacity=16, embedding_dtype=dtype,
                    initializer_args=init, module_kwargs=dict(seed=11, init_streams=[5, 9]))
    keys = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789, 7], dtype=torch.int64)
    n = keys.numel()
    weights = [torch.full((n, dim + 3), 9.0, dtype=dtype) for _ in range(2)]
    tids = torch.arange(n) % 2
    ops.emb_init_rows(weights, torch.arange(n), tids, keys, m.dims, m.storage.init_params, 11)
    for t in range(2):
        sel = (tids == t).nonzero().squeeze(1)
        want = ops.emb_forward(weights, torch.full((n,), -1), keys, sel, torch.tensor([0, sel.numel()]), [t],
                               m.dims, None, int(NONE), m.storage.init_params, 11, dtype)
        assert torch.equal(weights[t][sel, :dim], want)
        assert torch.equal(weights[t][sel, dim:], torch.zeros(sel.numel(), 3, dtype=dtype))


@pytest.mark.parametrize("dim,optimizer", [(16, "exact_sgd"), (64, "exact_sgd"), (128, "adam"), (64, "exact_adagrad")])
def test_many_new_keys_get_their_own_keys_values(dim, optimizer):
    """From 4096 keys on, a training forward writes the new keys' rows in the
    order of their rows (emb_row_order_init), not in the keys' order: each row
    still gets its own key's initial values (the scalar rule of emb_forward
    for keys without a row) and a zero optimizer state. Dims of 64k on float32
    rows take the vector path that streams rows from registers."""
    from dynamicemb._ops import ops
    n = 6000
    init = DynamicEmbInitializerArgs(mode=Mode.UNIFORM, lower=-0.3, upper=0.7)
    m = make_module([dim, dim], pooling=NONE, optimizer=optimizer, max_capacity=1 << 14, bucket_capacity=16,
                    initializer_args=init, module_kwargs=dict(seed=3))
    gen = torch.Generator().manual_seed(8)
    keys = torch.randint(-2**62, 2**62, (2 * n,), generator=gen)
    m(keys, torch.tensor([0, n, 2 * n]))  # n new keys per table
    for t in range(2):
        k = keys[t * n:(t + 1) * n]
        found, rows = stored(m, t, k)
        assert bool(found.all())
        want = ops.emb_forward(m.storage.weights(), torch.full((n,), -1), k, torch.arange(n), torch.tensor([0, n]),
                               [t], m.dims, None, int(NONE), m.storage.init_params, 3, torch.float32)
        assert torch.equal(rows[:, :dim], want)
        assert bool((rows[:, dim:] == 0).all())
