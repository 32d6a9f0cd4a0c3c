"""The emb_* ops on sample inputs, opchecked (schema, fake kernels, dynamic-shape
tracing) by the generated twin of every test (tests/op_checks.py), and the fake
kernels' shapes against the real kernels."""
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dynamicemb import DynamicEmbPoolingMode
from dynamicemb._ops import ops
from emb_helpers import bags, make_module, random_batch
from op_checks import generate_opcheck_tests, opcheck_every_call

ROWS_WHOLE = True  # conftest.py: these tests pass the kernels' list of row tensors themselves

FEATURE_TABLE = [0, 1, 0]
DIMS = [4, 8]


def _inputs(pooling=DynamicEmbPoolingMode.SUM):
    """A module with stored rows and one batch's unique / rows, as the forward builds them."""
    dims = [4, 4] if pooling == DynamicEmbPoolingMode.NONE else DIMS  # NONE needs one dim
    m = make_module(dims, pooling=pooling, feature_table_map=FEATURE_TABLE, optimizer="exact_row_wise_adagrad")
    indices, offsets = bags([[1, 2, 2], [5], [3, 1], [9, 1], [], [7]])  # F = 3, B = 2
    ukeys, utids, inverse, counts = ops.emb_unique(indices, offsets, FEATURE_TABLE, 2)
    res = m.storage.find_or_insert(ukeys, utids, counts, 1, inverse)
    return m, indices, offsets, res.keys, res.table_ids, res.inverse, res.rows


# The samples below are opchecked by their twins; _inputs() calls emb_unique.


@opcheck_every_call
def test_emb_init_rows_sample():
    m, _, _, ukeys, utids, _, rows = _inputs()
    weights = [w.clone() for w in m.storage.weights()]
    ops.emb_init_rows(weights, rows, utids, ukeys, m.dims, m.storage.init_params, 0)


@opcheck_every_call
@pytest.mark.parametrize("pooling", list(DynamicEmbPoolingMode), ids=lambda p: p.name)
def test_emb_forward_samples(pooling):
    m, _, offsets, ukeys, _, inverse, rows = _inputs(pooling)
    psw = None if pooling == DynamicEmbPoolingMode.NONE else torch.rand(inverse.numel())
    for dtype in (torch.float32, torch.bfloat16):
        args = (m.storage.weights(), rows, ukeys, inverse, offsets, FEATURE_TABLE, m.dims, psw, int(pooling),
                m.storage.init_params, 0, dtype)
        ops.emb_forward(*args)


@opcheck_every_call
@pytest.mark.parametrize("pooling", list(DynamicEmbPoolingMode), ids=lambda p: p.name)
def test_emb_backward_update_samples(pooling):
    m, _, offsets, ukeys, utids, inverse, rows = _inputs(pooling)
    out = ops.emb_forward(m.storage.weights(), rows, ukeys, inverse, offsets, FEATURE_TABLE, m.dims, None,
                          int(pooling), m.storage.init_params, 0, torch.float32)
    weights = [w.clone() for w in m.storage.weights()]
    args = (torch.randn(out.shape), weights, rows, utids, inverse, offsets, FEATURE_TABLE, m.dims, None,
            int(pooling), 3, 0.1, 1e-8, 0.9, 0.999, 0.0, 1, 0)
    ops.emb_backward_update(*args)


def _many_uniques():
    """~9000 unique keys of two tables with their rows (some -1: no row), in
    the order emb_unique gives them: enough for emb_row_order_init to reorder
    (from 4096 keys on)."""
    gen = torch.Generator().manual_seed(5)
    m = make_module(DIMS, feature_table_map=FEATURE_TABLE, max_capacity=1 << 14)
    indices, offsets = random_batch(gen, FEATURE_TABLE, [6000, 6000], batch=3000, max_len=4)
    ukeys, utids, inverse, counts = ops.emb_unique(indices, offsets, FEATURE_TABLE, 2)
    m.storage.find_or_insert(ukeys, utids, counts, 1)
    rows = m.storage.find(ukeys, utids)
    rows[::97] = -1
    return m, ukeys, utids, inverse, rows


def _no_shift(m):
    """slot_begin for slots that are the rows themselves."""
    return torch.zeros(len(m.dims), dtype=torch.int64)


def _row_order(m, rows, utids):
    """emb_row_order_init's order alone (no new rows, no inverse)."""
    none = torch.zeros(rows.numel(), dtype=torch.bool)
    return ops.emb_row_order_init(m.storage.weights(), rows, _no_shift(m), utids, torch.zeros_like(rows), none,
                                  rows.new_empty(0), m.dims, m.storage.init_params, 0)[0]


@opcheck_every_call
def test_emb_row_order_init_sample():
    m, ukeys, utids, inverse, rows = _many_uniques()
    is_new = torch.arange(ukeys.numel()) % 3 == 0
    weights = [w.clone() for w in m.storage.weights()]
    ops.emb_row_order_init(weights, rows, _no_shift(m), utids, ukeys, is_new, inverse, m.dims,
                           m.storage.init_params, 0)


def test_row_order_sorts_by_row_within_blocks():
    m, ukeys, utids, inverse, rows = _many_uniques()
    U = ukeys.numel()
    order = _row_order(m, rows, utids)
    assert torch.equal(torch.sort(order).values, torch.arange(U))  # a permutation
    assert not torch.equal(order, torch.arange(U))  # and not the identity
    r, t = rows[order], utids[order]
    # Keys without a row first, then rows in address order (tables end to
    # end) to within blocks of 2**s rows, the fewest that cut the rows into
    # at most U / 2 blocks (embedding_cpu.cpp kRowOrderPairsPerBlock); input
    # order within a block.
    base = torch.tensor([0] + [w.shape[0] for w in m.storage.weights()]).cumsum(0)
    none = int((rows < 0).sum())
    assert bool((r[:none] < 0).all()) and bool((r[none:] >= 0).all())
    s = 0
    while (int(base[-1]) >> s) > U // 2:
        s += 1
    step = torch.diff((base[t[none:]] + r[none:]) >> s)
    assert bool((step >= 0).all())
    assert bool((torch.diff(order[none:])[step == 0] > 0).all())
    assert bool((torch.diff(order[:none]) > 0).all())
    # Few keys: the input order.
    m, _, _, ukeys, utids, inverse, rows = _inputs()
    assert torch.equal(_row_order(m, rows, utids), torch.arange(ukeys.numel()))


@pytest.mark.parametrize("shifted", [False, True])
def test_row_order_init_permutes_renumbers_and_initialises_new_rows(shifted):
    m, ukeys, utids, inverse, rows = _many_uniques()
    U = ukeys.numel()
    is_new = torch.arange(U) % 3 == 0
    weights = [w.clone() for w in m.storage.weights()]
    slots, begin = _slots(m, rows, utids) if shifted else (rows, _no_shift(m))
    order, r, k, t, inv = ops.emb_row_order_init(weights, slots, begin, utids, ukeys, is_new, inverse, m.dims,
                                                 m.storage.init_params, 4)
    assert torch.equal(order, _row_order(m, rows, utids))
    assert torch.equal(r, rows[order]) and torch.equal(k, ukeys[order]) and torch.equal(t, utids[order])
    assert torch.equal(k[inv], ukeys[inverse]) and torch.equal(t[inv], utids[inverse])  # each index, its own key
    # New keys with a row: their initial values (emb_init_rows' rule) and zero
    # state; every other row untouched.
    want = [w.clone() for w in m.storage.weights()]
    sel = (is_new & (rows >= 0)).nonzero().squeeze(1)
    ops.emb_init_rows(want, rows[sel], utids[sel], ukeys[sel], m.dims, m.storage.init_params, 4)
    assert sel.numel() > 1000 and all(torch.equal(a, b) for a, b in zip(weights, want))
    with pytest.raises(RuntimeError, match=rf"inverse\[1\] = {U} names no key"):
        ops.emb_row_order_init(weights, slots, begin, utids, ukeys, is_new, torch.tensor([0, U]), m.dims,
                               m.storage.init_params, 4)
    with pytest.raises(RuntimeError, match="slot_begin has 1 entries for 2 tables"):
        ops.emb_row_order_init(weights, slots, begin[:1], utids, ukeys, is_new, inverse, m.dims,
                               m.storage.init_params, 4)


def _slots(m, rows, utids):
    """Slots of a hash table holding the tables one after another (from slot
    1000 on): a key's row is its slot less its table's first slot; -1 stays -1."""
    begin = torch.tensor([1000, 1000 + m.storage.weights()[0].shape[0]])
    return torch.where(rows >= 0, rows + begin[utids], rows), begin


@opcheck_every_call
def test_emb_slot_rows_init_sample():
    m, ukeys, utids, _, rows = _many_uniques()
    slots, begin = _slots(m, rows, utids)
    is_new = torch.arange(ukeys.numel()) % 3 == 0
    weights = [w.clone() for w in m.storage.weights()]
    ops.emb_slot_rows_init(weights, slots, begin, utids, ukeys, is_new, m.dims, m.storage.init_params, 0)


def test_slot_rows_init_gives_the_rows_and_initialises_the_new_ones():
    m, ukeys, utids, _, rows = _many_uniques()
    U = ukeys.numel()
    slots, begin = _slots(m, rows, utids)
    is_new = torch.arange(U) % 3 == 0
    # A new key whose slot lies past its table's rows: skipped (emb_init_rows' skip_bad), its row as computed.
    slots[5], is_new[5] = begin[int(utids[5])] + m.storage.weights()[int(utids[5])].shape[0], True
    weights = [w.clone() for w in m.storage.weights()]
    got = ops.emb_slot_rows_init(weights, slots, begin, utids, ukeys, is_new, m.dims, m.storage.init_params, 4)
    want_rows = torch.where(slots >= 0, slots - begin[utids], slots)
    assert torch.equal(got, want_rows) and int((got < 0).sum()) > 50
    # The new keys with a row in range: their initial values and zero state
    # (emb_init_rows' rule); every other row untouched.
    want = [w.clone() for w in m.storage.weights()]
    sel = (is_new & (rows >= 0)).nonzero().squeeze(1)
    sel = sel[sel != 5]
    ops.emb_init_rows(want, rows[sel], utids[sel], ukeys[sel], m.dims, m.storage.init_params, 4)
    assert sel.numel() > 1000 and all(torch.equal(a, b) for a, b in zip(weights, want))
    with pytest.raises(RuntimeError, match="slot_begin has 1 entries for 2 tables"):
        ops.emb_slot_rows_init(weights, slots, begin[:1], utids, ukeys, is_new, m.dims, m.storage.init_params, 4)
    with pytest.raises(RuntimeError, match="slots, table_ids, keys and is_new differ in length"):
        ops.emb_slot_rows_init(weights, slots, begin, utids, ukeys, is_new[:-1], m.dims, m.storage.init_params, 4)


@pytest.mark.parametrize("bad", [-1, "U"])
def test_forward_and_backward_reject_an_inverse_that_names_no_key(bad):
    m, _, offsets, ukeys, utids, inverse, rows = _inputs()
    inverse = inverse.clone()
    inverse[3] = ukeys.numel() if bad == "U" else bad
    msg = rf"inverse\[3\] = {int(inverse[3])} names no key"
    with pytest.raises(RuntimeError, match=msg):
        ops.emb_forward(m.storage.weights(), rows, ukeys, inverse, offsets, FEATURE_TABLE, m.dims, None,
                        int(DynamicEmbPoolingMode.SUM), m.storage.init_params, 0, torch.float32)
    weights = [w.clone() for w in m.storage.weights()]
    with pytest.raises(RuntimeError, match=msg):
        ops.emb_backward_update(torch.randn(2, 16), weights, rows, utids, inverse, offsets, FEATURE_TABLE, m.dims,
                                None, int(DynamicEmbPoolingMode.SUM), 3, 0.1, 1e-8, 0.9, 0.999, 0.0, 1, 0)
    assert all(torch.equal(a, b) for a, b in zip(weights, m.storage.weights()))  # nothing updated


def test_training_forward_renumbers_keys_in_row_order():
    # What the backward sees: the batch's keys in the order of their rows, each
    # index still naming its own key and row.
    m, *_ = _many_uniques()
    gen = torch.Generator().manual_seed(6)
    indices, offsets = random_batch(gen, FEATURE_TABLE, [6000, 6000], batch=3000, max_len=4)
    seen = {}
    apply = m._apply_gradients

    def spy(grad_output, rows, utids, inverse, offsets, psw):
        seen.update(rows=rows, utids=utids, inverse=inverse)
        return apply(grad_output, rows, utids, inverse, offsets, psw)

    m._apply_gradients = spy
    m(indices, offsets).sum().backward()
    ukeys, utids, inverse, _ = ops.emb_unique(indices, offsets, FEATURE_TABLE, 2)
    want_rows = m.storage.find(ukeys, utids)
    assert torch.equal(seen["rows"][seen["inverse"]], want_rows[inverse])
    assert torch.equal(seen["utids"][seen["inverse"]], utids[inverse])
    assert torch.equal(_row_order(m, seen["rows"], seen["utids"]), torch.arange(ukeys.numel()))


@pytest.mark.parametrize("pooling", list(DynamicEmbPoolingMode), ids=lambda p: p.name)
def test_fake_shapes_match_real(pooling):
    m, indices, offsets, ukeys, utids, inverse, rows = _inputs(pooling)
    real = ops.emb_forward(m.storage.weights(), rows, ukeys, inverse, offsets, FEATURE_TABLE, m.dims, None,
                           int(pooling), m.storage.init_params, 0, torch.float16)
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fake = lambda t: mode.from_tensor(t)  # noqa: E731
        fu = ops.emb_unique(fake(indices), fake(offsets), FEATURE_TABLE, 2)
        assert fu[2].shape == indices.shape
        out = ops.emb_forward([fake(w) for w in m.storage.weights()], fake(rows), fake(ukeys), fake(inverse),
                              fake(offsets), FEATURE_TABLE, m.dims, None, int(pooling),
                              fake(m.storage.init_params), 0, torch.float16)
    assert tuple(out.shape) == tuple(real.shape) and out.dtype == real.dtype


def test_lookup_compiles_and_exports_with_dynamic_shapes():
    # The eval lookup path (unique -> gather + pool) as an inference module
    # would trace it: the data-dependent unique count flows into emb_forward.
    m, indices, offsets, *_ = _inputs()
    weights, params = m.storage.weights(), m.storage.init_params

    class Lookup(torch.nn.Module):
        def forward(self, idx, off):
            uk, _, inv, _ = ops.emb_unique(idx, off, FEATURE_TABLE, 2)
            rows = torch.full_like(uk, -1)
            return ops.emb_forward(weights, rows, uk, inv, off, FEATURE_TABLE, DIMS, None, 0, params, 0,
                                   torch.float32)

    f = Lookup()
    other = bags([[1, 2], [5, 6, 8], [3], [9, 1, 1], [], [7], [], [4], [4, 4]])  # B = 3
    expected = [f(indices, offsets), f(*other)]
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")  # no C++ codegen: fast
    for args, exp in zip([(indices, offsets), other], expected):
        torch.testing.assert_close(compiled(*args), exp, atol=0, rtol=0)
    dims = ({0: torch.export.Dim("n")}, {0: 3 * torch.export.Dim("b", min=2) + 1})  # offsets: F * B + 1
    exported = torch.export.export(f, (indices, offsets), dynamic_shapes=dims).module()
    for args, exp in zip([(indices, offsets), other], expected):
        torch.testing.assert_close(exported(*args), exp, atol=0, rtol=0)


def test_backward_update_refuses_unknown_codes():
    m, _, offsets, ukeys, utids, inverse, rows = _inputs(DynamicEmbPoolingMode.SUM)
    out = ops.emb_forward(m.storage.weights(), rows, ukeys, inverse, offsets, FEATURE_TABLE, m.dims, None, 0,
                          m.storage.init_params, 0, torch.float32)
    weights = [w.clone() for w in m.storage.weights()]
    for optimizer, mode, msg in ((9, 0, "unknown optimizer 9"), (3, 7, "unknown weight_decay_mode 7")):
        with pytest.raises(RuntimeError, match=msg):
            ops.emb_backward_update(torch.randn(out.shape), weights, rows, utids, inverse, offsets, FEATURE_TABLE,
                                    m.dims, None, 0, optimizer, 0.1, 1e-8, 0.9, 0.999, 0.0, 1, mode)
    assert all(torch.equal(a, b) for a, b in zip(weights, m.storage.weights()))


def _table_reference():
    """tests/table/reference.py (the table's Python model: fmix64)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("table_reference", Path(__file__).parent.parent / "table" / "reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("n_bags", [40, 3000], ids=["one-part", "64-parts"])
def test_unique_order_matches_a_python_model(n_bags):
    # unique_rules.h: (key, table) hashed with the table's salt; from 4096
    # indices on the hash's top 6 bits pick one of 64 parts; uniques come part
    # by part, in order of first occurrence within a part.
    fmix64 = _table_reference().fmix64
    gen = torch.Generator().manual_seed(3)
    indices, offsets = random_batch(gen, FEATURE_TABLE, [500, 300], batch=n_bags, max_len=4)
    indices = indices * 7919 - 10**6  # negative keys too
    ukeys, utids, inverse, counts = ops.emb_unique(indices, offsets, FEATURE_TABLE, 2)
    B, n = n_bags, indices.numel()
    off = offsets.tolist()
    pairs = [(k, FEATURE_TABLE[j // B]) for j in range(len(off) - 1) for k in indices[off[j]:off[j + 1]].tolist()]

    def part(k, t):
        return fmix64((k & (2**64 - 1)) ^ fmix64(t + 1)) >> 58 if n >= 4096 else 0

    first, cnt = {}, {}
    for p in pairs:
        first.setdefault(p, len(first))
        cnt[p] = cnt.get(p, 0) + 1
    want = sorted(first, key=lambda p: (part(*p), first[p]))
    assert list(zip(ukeys.tolist(), utids.tolist())) == want
    assert counts.tolist() == [cnt[p] for p in want]
    pos = {p: u for u, p in enumerate(want)}
    assert inverse.tolist() == [pos[p] for p in pairs]


generate_opcheck_tests(sys.modules[__name__])
