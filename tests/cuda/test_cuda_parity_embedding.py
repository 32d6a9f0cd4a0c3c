"""CUDA kernels vs the CPU kernels (which define the semantics): the emb_* and
route_* ops on the same inputs give bit-identical results. Skipped without a
GPU; DYNAMICEMB_PARITY_DEVICE=cpu runs them CPU against CPU (cuda_parity.py)."""
import pytest
import torch

from cuda_parity import DEV, PARITY_MARKS, same
from dynamicemb import ScoredHashTable, rules
from dynamicemb._ops import ops

pytestmark = PARITY_MARKS
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def batch(gen, F, B, max_len, key_range):
    lengths = torch.randint(0, max_len + 1, (F * B,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    indices = torch.randint(-key_range // 4, key_range, (int(offsets[-1]),), generator=gen)
    return indices, offsets


def init_params(modes, streams=None):
    """The packed initializer (rules.INIT_ARGS' columns) of one table per mode;
    a new row's optimizer state starts at 0.125."""
    rows = []
    for t, m in enumerate(modes):
        args = dict(mode=m, mean=0.1, std_dev=0.5, lower=-0.4, upper=0.6, value=0.25,
                    stream=t if streams is None else streams[t], state=0.125)
        rows.append([args[k] for k in rules.INIT_ARGS])
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("n_scale", [1, 40])  # one hash part / 64 parts (n >= 4096)
@pytest.mark.parametrize("feature_table,num_tables", [([0, 0], 2), ([0, 1, 0], 2), ([4, 0, 3, 1, 2, 4], 5)])
def test_unique(n_scale, feature_table, num_tables):
    gen = torch.Generator().manual_seed(n_scale)
    idx, off = batch(gen, len(feature_table), 30 * n_scale, 8, 300)
    ref = ops.emb_unique(idx, off, feature_table, num_tables)
    got = ops.emb_unique(idx.to(DEV), off.to(DEV), feature_table, num_tables)
    for a, b in zip(ref, got):
        same(a, b)


@pytest.mark.parametrize("n_scale", [0, 1, 40])  # no index / one hash part / 64 parts
def test_unique_padded(n_scale):
    # Also the offsets' record, which the CUDA op leaves on the device unread.
    gen = torch.Generator().manual_seed(n_scale + 7)
    idx, off = batch(gen, 3, 30 * n_scale, 8, 300)
    ref = ops.emb_unique_padded(idx, off, [0, 1, 0], 2)
    got = ops.emb_unique_padded(idx.to(DEV), off.to(DEV), [0, 1, 0], 2)
    for a, b in zip(ref, got):
        same(a, b)


def setup_rows(gen, dims, state, dtype, caps=64):
    return [torch.randn(caps, d + s, generator=gen).to(dtype) for d, s in zip(dims, state)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_init_rows(dtype):
    gen = torch.Generator().manual_seed(1)
    dims, n = [5, 40, 300, 8, 3], 50
    weights = setup_rows(gen, dims, [1, 40, 0, 2, 6], dtype)
    rows = torch.randint(-1, 64, (n,), generator=gen)
    tids = torch.randint(0, len(dims), (n,), generator=gen)
    keys = torch.randint(-2**62, 2**62, (n,), generator=gen)
    keep = torch.ones(n, dtype=torch.bool)  # one key per (table, row): no write races
    seen = set()
    for i in range(n):
        keep[i] = (int(tids[i]), int(rows[i])) not in seen
        seen.add((int(tids[i]), int(rows[i])))
    rows, tids, keys = rows[keep], tids[keep], keys[keep]
    params = init_params([0, 1, 2, 3, 4])
    cuda_w = [w.to(DEV) for w in weights]
    ops.emb_init_rows(weights, rows, tids, keys, dims, params, 7)
    ops.emb_init_rows(cuda_w, rows.to(DEV), tids.to(DEV), keys.to(DEV), dims, params, 7)
    for a, b in zip(weights, cuda_w):
        same(a, b)


def test_init_rows_skip_bad_skips_pairs_out_of_range():
    # skip_bad: the pairs in range are written as without it, the others (a
    # row past its table, a table id out of range) are skipped, not raised.
    gen = torch.Generator().manual_seed(4)
    dims = [6, 40]
    weights = setup_rows(gen, dims, [1, 0], torch.float32)
    rows, tids = torch.tensor([3, 64, 7, 9, 2]), torch.tensor([0, 0, 1, 2, -1])
    keys = torch.tensor([11, 12, 13, 14, 15])
    params = init_params([0, 2])
    with pytest.raises(RuntimeError, match="row 64 of table 0 is out of range"):
        ops.emb_init_rows([w.clone() for w in weights], rows, tids, keys, dims, params, 7)
    want = [w.clone() for w in weights]
    ops.emb_init_rows(want, rows[[0, 2]], tids[[0, 2]], keys[[0, 2]], dims, params, 7)
    for dev in ("cpu", DEV):
        got = [w.to(dev) for w in weights]
        ops.emb_init_rows(got, rows.to(dev), tids.to(dev), keys.to(dev), dims, params, 7, skip_bad=True)
        for a, b in zip(want, got):
            same(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_rows_init(dtype):
    # The rows from slots (a table's first slot subtracted, -1 kept, a slot
    # past its table's rows and a table id out of range kept as the CPU
    # computes them) and the new keys' rows written, the bad ones skipped.
    gen = torch.Generator().manual_seed(6)
    dims, n = [5, 40, 8], 60
    weights = setup_rows(gen, dims, [1, 0, 2], dtype)
    begin = torch.tensor([0, 64, 128])
    rows = torch.randperm(64, generator=gen)[:n]
    tids = torch.randint(0, len(dims), (n,), generator=gen)
    slots = torch.where(torch.rand(n, generator=gen) < 0.2, torch.tensor(-1), rows + begin[tids])
    slots[3], tids[7] = begin[int(tids[3])] + 64, 3  # a row past its table; a table id out of range
    keys = torch.randint(-2**62, 2**62, (n,), generator=gen)
    is_new = torch.rand(n, generator=gen) < 0.5
    params = init_params([0, 2, 4])
    want_w = [w.clone() for w in weights]
    want = ops.emb_slot_rows_init(want_w, slots, begin, tids, keys, is_new, dims, params, 7)
    got_w = [w.to(DEV) for w in weights]
    got = ops.emb_slot_rows_init(got_w, slots.to(DEV), begin.to(DEV), tids.to(DEV), keys.to(DEV), is_new.to(DEV),
                                 dims, params, 7)
    same(want, got)
    for a, b in zip(want_w, got_w):
        same(a, b)


def lookup_inputs(gen, feature_table, num_tables, B, dims, dtype, state=None, missing=0.2):
    idx, off = batch(gen, len(feature_table), B, 6, 200)
    ukeys, utids, inverse, counts = ops.emb_unique(idx, off, feature_table, num_tables)
    weights = setup_rows(gen, dims, state or [0] * num_tables, dtype, caps=512)
    rows = torch.randperm(512, generator=gen)[:ukeys.numel()]
    rows[torch.rand(ukeys.numel(), generator=gen) < missing] = -1
    return idx, off, ukeys, utids, inverse, weights, rows


@pytest.mark.parametrize("pooling", [0, 1, 2], ids=["sum", "mean", "none"])
@pytest.mark.parametrize("wdtype", DTYPES)
@pytest.mark.parametrize("odtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("psw", [False, True])
def test_forward(pooling, wdtype, odtype, psw):
    if pooling == 2 and psw:
        pytest.skip("per_sample_weights need pooling")
    gen = torch.Generator().manual_seed(2)
    feature_table = [0, 1, 0]
    dims = [24, 24] if pooling == 2 else [7, 300]  # 300 > one 256-wide chunk
    idx, off, ukeys, utids, inverse, weights, rows = lookup_inputs(gen, feature_table, 2, 20, dims, wdtype)
    w = torch.randn(idx.numel(), generator=gen) if psw else None
    params = init_params([0, 2])
    ref = ops.emb_forward(weights, rows, ukeys, inverse, off, feature_table, dims, w, pooling, params, 3, odtype)
    got = ops.emb_forward([x.to(DEV) for x in weights], rows.to(DEV), ukeys.to(DEV), inverse.to(DEV), off.to(DEV),
                          feature_table, dims, None if w is None else w.to(DEV), pooling, params, 3, odtype)
    same(ref, got)


STATE = {0: lambda d: 0, 1: lambda d: 2 * d, 2: lambda d: d, 3: lambda d: 1}


@pytest.mark.parametrize("optimizer", [0, 1, 2, 3], ids=["sgd", "adam", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("pooling", [0, 1, 2], ids=["sum", "mean", "none"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("psw", [False, True])
@pytest.mark.parametrize("decay", [0, 1, 2], ids=["no_decay", "l2", "decoupled"])
def test_backward_update(optimizer, pooling, wdtype, psw, decay):
    if pooling == 2 and psw:
        pytest.skip("per_sample_weights need pooling")
    if decay and optimizer != 3:
        pytest.skip("weight_decay_mode is EXACT_ROWWISE_ADAGRAD's")
    gen = torch.Generator().manual_seed(3)
    feature_table = [0, 1, 0]
    dims = [24, 24] if pooling == 2 else [7, 300]
    state = [STATE[optimizer](d) for d in dims]
    idx, off, ukeys, utids, inverse, weights, rows = lookup_inputs(gen, feature_table, 2, 20, dims, wdtype, state)
    for w, d in zip(weights, dims):  # non-negative optimizer state
        w[:, d:] = w[:, d:].abs()
    w_ps = torch.randn(idx.numel(), generator=gen) if psw else None
    out_shape = (idx.numel(), dims[0]) if pooling == 2 else ((off.numel() - 1) // 3, sum(dims[t] for t in feature_table))
    grad = torch.randn(out_shape, generator=gen)
    cuda_w = [x.to(DEV) for x in weights]
    args = (pooling, optimizer, 0.05, 1e-3, 0.9, 0.99, 0.01, 3, decay)
    ops.emb_backward_update(grad, weights, rows, utids, inverse, off, feature_table, dims, w_ps, *args)
    ops.emb_backward_update(grad.to(DEV), cuda_w, rows.to(DEV), utids.to(DEV), inverse.to(DEV), off.to(DEV),
                            feature_table, dims, None if w_ps is None else w_ps.to(DEV), *args)
    for a, b in zip(weights, cuda_w):
        same(a, b)


@pytest.mark.parametrize("optimizer", [0, 3], ids=["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("pooling", [0, 2], ids=["sum", "none"])
def test_backward_update_skips_rows_whose_gradient_is_not_finite(optimizer, pooling):
    # A NaN, an inf, and finite entries whose sum overflows, into rows of one
    # chunk (dim 7) and of two (300). Reference: the same update with those
    # rows given no row (-1), and their count per table taken by hand.
    gen = torch.Generator().manual_seed(11)
    feature_table = [0, 1, 0]
    dims = [24, 24] if pooling == 2 else [7, 300]
    state = [STATE[optimizer](d) for d in dims]
    idx, off, ukeys, utids, inverse, weights, rows = lookup_inputs(gen, feature_table, 2, 20, dims, torch.float32,
                                                                   state, missing=0.1)
    for w, d in zip(weights, dims):
        w[:, d:] = w[:, d:].abs()
    B = (off.numel() - 1) // 3
    grad = torch.randn((idx.numel(), dims[0]) if pooling == 2 else (B, sum(dims[t] for t in feature_table)),
                       generator=gen)
    # Output rows (pooling NONE: index i; else bag b's slice of feature f) and the unique keys they reach.
    def reached(i=None, f=None, b=None):
        if pooling == 2:
            return {int(inverse[i])}
        j = f * B + b
        return {int(u) for u in inverse[off[j]:off[j + 1]]}
    cols = [0, dims[0], dims[0] + dims[1]]  # each feature's first column (pooled)
    bad = set()
    if pooling == 2:
        grad[3, 1], grad[5, 0] = float("nan"), float("inf")
        bad |= reached(i=3) | reached(i=5)
        counts = torch.bincount(inverse, minlength=ukeys.numel())
        u = int(((counts > 1) & (rows >= 0)).nonzero()[0])  # a key given twice: its sum overflows
        grad[(inverse == u).nonzero().squeeze(1), 2] = 3e38
        bad.add(u)
    else:
        # Column 2 of feature 0 at 3e38 in every bag: a key given more than once there overflows.
        grad[:, cols[0] + 2] = 3e38
        twice = torch.bincount(inverse[:int(off[B])], minlength=ukeys.numel()) > 1
        assert bool((twice & (rows >= 0)).any())
        bad |= set(twice.nonzero().squeeze(1).tolist())
        b = next(b for b in range(B) if off[b + 1] > off[b])  # a non-empty bag of feature 0
        grad[b, cols[0] + 1] = float("nan")
        bad |= reached(f=0, b=b)
        b2 = next(b for b in range(B) if off[B + b + 1] > off[B + b])  # feature 1 (dim 300): the 2nd chunk
        grad[b2, cols[1] + 290] = float("-inf")
        bad |= reached(f=1, b=b2)
    bad = {u for u in bad if rows[u] >= 0}
    assert bad
    want_w = [w.clone() for w in weights]
    masked = rows.clone()
    masked[sorted(bad)] = -1
    args = (pooling, optimizer, 0.05, 1e-3, 0.9, 0.99, 0.01, 3, 0)
    none = ops.emb_backward_update(grad, want_w, masked, utids, inverse, off, feature_table, dims, None, *args)
    assert none.tolist() == [0, 0]  # not asked to check: nothing counted
    want = torch.bincount(utids[sorted(bad)], minlength=2)
    cpu_w = [w.clone() for w in weights]
    got = ops.emb_backward_update(grad, cpu_w, rows, utids, inverse, off, feature_table, dims, None, *args,
                                  skip_nonfinite=True)
    assert torch.equal(got, want)
    for a, b in zip(cpu_w, want_w):
        same(a, b)
    dev_w = [w.to(DEV) for w in weights]
    got_dev = ops.emb_backward_update(grad.to(DEV), dev_w, rows.to(DEV), utids.to(DEV), inverse.to(DEV),
                                      off.to(DEV), feature_table, dims, None, *args, skip_nonfinite=True)
    same(got_dev, want)
    for a, b in zip(dev_w, want_w):
        same(a, b)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("with_weights", [False, True])
def test_route_keys(world, with_weights):
    gen = torch.Generator().manual_seed(world)
    rules, params = [0, 1, 2, 3], [37, 1, 1, 1000]
    lengths = torch.randint(0, 5, (4 * 25,), generator=gen)
    values = torch.randint(-2**40, 2**40, (int(lengths.sum()),), generator=gen)
    values[::7] = torch.randint(0, 37 * world, (values[::7].numel(),), generator=gen)
    w = torch.rand(values.numel(), generator=gen) if with_weights else None
    ref = ops.route_keys(lengths, values, w, rules, params, world)
    got = ops.route_keys(lengths.to(DEV), values.to(DEV), None if w is None else w.to(DEV), rules, params, world)
    for a, b in zip(ref, got):
        same(a, b)


@pytest.mark.parametrize("rule,param", [(0, 37), (1, 1), (2, 1), (3, 1000)])
def test_route_owners(rule, param):
    keys = torch.randint(-2**62, 2**62, (1000,), generator=torch.Generator().manual_seed(rule))
    same(ops.route_owners(keys, rule, param, 5), ops.route_owners(keys.to(DEV), rule, param, 5))


def test_bad_offsets_raise_like_cpu():
    idx = torch.arange(4)
    off = torch.tensor([0, 3, 2, 4])
    with pytest.raises(RuntimeError, match="non-decreasing"):
        ops.emb_unique(idx.to(DEV), off.to(DEV), [0], 1)
    with pytest.raises(RuntimeError, match="negative length"):
        ops.route_keys(torch.tensor([2, -1, 3]).to(DEV), idx.to(DEV), None, [1], [1], 2)


def test_offsets_changed_in_place_after_their_check_are_checked_again():
    """On CUDA a step's ops check its offsets once (checked_once.h); offsets
    written in place since are a new version: every op checks them again."""
    gen = torch.Generator().manual_seed(5)
    idx, off, ukeys, utids, inverse, weights, rows = lookup_inputs(gen, [0, 1], 2, 6, [4, 4], torch.float32)
    idx, off, ukeys, inverse, rows = (t.to(DEV) for t in (idx, off, ukeys, inverse, rows))
    weights = [w.to(DEV) for w in weights]
    fwd = lambda o: ops.emb_forward(weights, rows, ukeys, inverse, o, [0, 1], [4, 4], None, 0,  # noqa: E731
                                    init_params([0, 0]), 3, torch.float32)
    ops.emb_unique(idx, off, [0, 1], 2)
    before = fwd(off)
    good = off.clone()
    off[3] = off[4] + 1  # offsets[4] < offsets[3]
    with pytest.raises(RuntimeError, match="non-decreasing"):
        ops.emb_unique(idx, off, [0, 1], 2)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        fwd(off)
    off.copy_(good)  # valid again, in place: checked, then the same output
    same(fwd(off), before)
    off[-1] += 1
    with pytest.raises(RuntimeError, match="offsets end at"):
        fwd(off)


@pytest.mark.parametrize("bad", [-1, "U"])
def test_an_inverse_that_names_no_key_is_refused_like_cpu(bad):
    """emb_forward and emb_backward_update check inverse on CUDA as on the CPU;
    emb_unique's own inverse skips that check until it is written in place."""
    gen = torch.Generator().manual_seed(6)
    idx, off, ukeys, utids, inverse, weights, rows = lookup_inputs(gen, [0, 1], 2, 6, [4, 4], torch.float32)
    d_idx, d_off = idx.to(DEV), off.to(DEV)
    d_ukeys, d_utids, d_inverse, _ = ops.emb_unique(d_idx, d_off, [0, 1], 2)
    d_rows, d_weights = rows.to(DEV), [w.to(DEV) for w in weights]
    params = init_params([0, 0])

    def fwd(inv, dev_side):
        w, r, k, o = (d_weights, d_rows, d_ukeys, d_off) if dev_side else (weights, rows, ukeys, off)
        return ops.emb_forward(w, r, k, inv, o, [0, 1], [4, 4], None, 0, params, 3, torch.float32)

    def bwd(inv, dev_side):
        w, r, t, o = (d_weights, d_rows, d_utids, d_off) if dev_side else (weights, rows, utids, off)
        g = torch.ones(6, 8, device=o.device)
        ops.emb_backward_update(g, [x.clone() for x in w], r, t, inv, o, [0, 1], [4, 4], None, 0, 0, 0.1, 1e-8,
                                0.9, 0.999, 0.0, 1, 0, 0.0)
    same(fwd(d_inverse, True), fwd(inverse, False))  # emb_unique's inverse: the CPU's output
    value = ukeys.numel() if bad == "U" else bad
    d_inverse[3] = value  # in place: a new version, checked again
    inverse = inverse.clone()
    inverse[3] = value
    msg = rf"inverse\[3\] = {value} names no key \({ukeys.numel()} keys\)"
    for call in (fwd, bwd):
        for inv, dev_side in ((inverse, False), (d_inverse, True)):
            with pytest.raises(RuntimeError, match=msg):
                call(inv, dev_side)


def test_table_ids_changed_in_place_after_unique_are_checked_again():
    """emb_unique's table ids skip the table ops' range check until written in place."""
    idx = torch.arange(12, device=DEV)
    off = torch.arange(0, 13, 3, device=DEV)
    ukeys, utids, _, _ = ops.emb_unique(idx, off, [0, 1], 2)
    t = ScoredHashTable(capacity=64, num_tables=2, bucket_capacity=16, device=DEV)
    t.insert(ukeys, utids)
    assert t.lookup(ukeys, utids)[1].all()
    utids[5] = 2
    with pytest.raises(RuntimeError, match=r"table id 2 \(key position 5\) is out of range \[0, 2\)"):
        t.insert(ukeys, utids)
    with pytest.raises(RuntimeError, match="table id 2"):
        t.lookup(ukeys, utids)


@pytest.mark.parametrize("pooling", [0, 1, 2], ids=["sum", "mean", "none"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_lookup_forward(pooling, wdtype):
    """emb_lookup_forward over two hash-table groups (a module's tables,
    trained on the CPU, copied to the device): same output as the CPU's."""
    from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbInitializerArgs, DynamicEmbInitializerMode,
                            DynamicEmbScoreStrategy, DynamicEmbTableOptions)
    S = DynamicEmbScoreStrategy
    ev = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.UNIFORM, lower=-1.0, upper=1.0)
    opts = [DynamicEmbTableOptions(dim=8, max_capacity=128, bucket_capacity=16, embedding_dtype=wdtype,
                                   score_strategy=s, eval_initializer_args=ev) for s in (S.TIMESTAMP, S.LFU, S.LFU)]
    ftab = [2, 0, 1, 0]
    m = BatchedDynamicEmbeddingTables(opts, feature_table_map=ftab, pooling_mode=("SUM", "MEAN", "NONE")[pooling],
                                      seed=3)
    gen = torch.Generator().manual_seed(21)
    idx, off = batch(gen, len(ftab), 5, 6, 100)
    m(idx, off).sum().backward()
    idx, off = batch(gen, len(ftab), 5, 6, 200)  # about half missing
    st = m.storage
    hts = [ht for ht, _ in st.groups]
    psw = torch.rand(idx.numel(), generator=gen) if pooling != 2 else None

    def run(d):
        mv = lambda ts: [t.to(d) for t in ts]  # noqa: E731
        return ops.emb_lookup_forward(mv([h.slot_keys for h in hts]), mv([h.slot_digests for h in hts]),
                                      mv([h.table_buckets for h in hts]), [h.bucket_capacity for h in hts],
                                      st._table_group, st._table_local, mv(st.weights()), idx.to(d), off.to(d),
                                      ftab, m.dims, None if psw is None else psw.to(d), pooling,
                                      st.eval_init_params, 3, torch.float32)

    same(run("cpu"), run(DEV))
