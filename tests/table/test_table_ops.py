"""The dynamicemb::table_* ops: registration (opcheck: schema, fake kernels,
compilation; generated for every test, tests/op_checks.py) and clear errors for
bad inputs, through Python and the raw ops."""
import sys
import time

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

from dynamicemb import DynamicEmbScoreStrategy as S
from dynamicemb import InsertResult, ScoredHashTable
from dynamicemb._ops import ops, table_arg
from op_checks import generate_opcheck_tests, opcheck_every_call

TABLE_OPS = ["table_lookup", "table_lookup_gather", "table_lookup_refresh", "table_refresh", "table_insert",
             "table_insert_outcome", "table_erase", "table_take", "table_export_range", "table_rehash"]


def _table(strategy):
    """Two tables (2 and 3 buckets of 16), partly filled, with a tombstone."""
    t = ScoredHashTable([32, 48], 16, strategy, num_tables=2)
    keys = torch.arange(-40, 40)
    t.insert(keys, torch.tensor([0, 1] * 40), scores=None if strategy == S.TIMESTAMP else 3)
    t.erase(keys[:6], torch.tensor([0, 1] * 3))
    return t


def _samples(t: ScoredHashTable, code: int):
    """(op name, args) covering optional inputs given and omitted."""
    keys = torch.tensor([5, -3, 100, 5, 7, 2**63 - 1])
    tids = torch.tensor([0, 1, 1, 0, 0, 1])
    kscores = torch.tensor([1, 2, 3, 4, 5, 6])
    bc, tab = t.bucket_capacity, table_arg(t)
    for tid, ks in [(tids, kscores), (tids, None)]:
        yield "table_lookup", (tab, keys, tid, bc)
        for dtype in (torch.float32, torch.bfloat16):
            values = torch.randn(t.slot_keys.numel(), 5).to(dtype)
            yield "table_lookup_gather", (tab, keys, tid, bc, values, values.new_empty(keys.numel(), 5))
        yield "table_lookup_refresh", (tab, keys, tid, ks, code, bc, 77)
        yield "table_refresh", (tab, torch.tensor([0, 3, -1, 17, 40, 79]), ks, code, 77)
        yield "table_insert", (tab, keys, tid, ks, code, bc, 78, 200)
        yield "table_insert_outcome", (torch.tensor([0, 1, 2, 3, 3, 0], dtype=torch.int8), tid, 2)
        yield "table_erase", (tab, keys, tid, bc)
        yield "table_take", (tab, keys, tid, bc, torch.arange(t.slot_keys.numel()) * 3)
    yield "table_export_range", (tab, None, 0, 80, bc, 0)
    yield "table_export_range", (tab, t.slot_scores, 16, 48, bc, 3)
    yield "table_rehash", (tab, torch.tensor([0, 4, 7]), bc)


@opcheck_every_call
@pytest.mark.parametrize("strategy,code", [(S.STEP, 1), ((S.TIMESTAMP, S.LFU), 5)])
def test_every_table_op_on_samples(strategy, code):
    """Each table op on samples that give and omit its optional inputs; the
    generated twin opchecks these calls (tests/op_checks.py). Each call runs on
    copies, so every sample sees the same table and the table never changes.
    test_autograd_registration passes vacuously: integer tensors cannot
    require grad, and these ops have no autograd formula."""
    t = _table(strategy)
    state = [x.clone() for x in (t.slot_keys, t.slot_digests, t.slot_scores, t.slot_timestamps, t.sizes)]
    called = set()
    for name, args in _samples(t, code):
        getattr(ops, name)(*pytree.tree_map_only(torch.Tensor, torch.clone, args))
        called.add(name)
    assert called == set(TABLE_OPS)
    now = (t.slot_keys, t.slot_digests, t.slot_scores, t.slot_timestamps, t.sizes)
    assert all(torch.equal(a, b) for a, b in zip(state, now))  # the ops ran on copies


def test_every_table_op_is_covered():
    # The library's ops as the dispatcher lists them (dir(ops) names only the ops looked up so far).
    prefix = "dynamicemb::table_"
    names = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix)}
    assert names == set(TABLE_OPS) | {"table_clock"}


def test_table_clock_is_the_monotonic_clock_on_cpu():
    """The clock strategies score with the table's clock: on the CPU,
    CLOCK_MONOTONIC (time.monotonic_ns), so a TIMESTAMP insert's scores lie
    between two readings taken around it. (Its opcheck twin leaves out the
    AOT test: a clock gives a new value on every call; op_checks.NO_AOT.)"""
    t = ScoredHashTable(64, 16, S.TIMESTAMP)
    before = time.monotonic_ns()
    now = t.now()
    t.insert(torch.arange(10))
    after = time.monotonic_ns()
    assert before <= now <= after
    (batch,) = list(t.export())
    assert bool(((batch.scores >= now) & (batch.scores <= after)).all())
    assert ops.table_clock(t.slot_scores).dtype == torch.int64


# ---- bad inputs ---------------------------------------------------------------------


@pytest.fixture
def t():
    return ScoredHashTable([32, 16], 16, S.STEP, num_tables=2)


def test_float_keys(t):
    with pytest.raises(TypeError, match="keys must be an integer tensor \\(int64\\), got torch.float32"):
        t.insert(torch.tensor([1.0, 2.0]), 0)
    with pytest.raises(TypeError, match="keys must be an integer tensor"):
        t.lookup(torch.tensor([1.0]), 0)
    with pytest.raises(RuntimeError, match="keys must be Long, got Float"):
        ops.table_lookup(table_arg(t), torch.tensor([1.0]), None, 16)


def test_keys_not_1d(t):
    with pytest.raises(ValueError, match=r"keys must be 1-D, got shape \(2, 2\)"):
        t.insert(torch.ones(2, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="keys must be 1-D, got shape \\(\\)"):
        t.erase(torch.tensor(3), 0)
    with pytest.raises(RuntimeError, match=r"keys must be 1-D, got shape \[2, 2\]"):
        ops.table_lookup(table_arg(t), torch.ones(2, 2, dtype=torch.int64), None, 16)


def test_table_ids_out_of_range(t):
    keys = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"table id 2 is out of range \[0, 2\)"):
        t.insert(keys, 2)
    with pytest.raises(ValueError, match="table_ids are required: the table holds 2 logical tables"):
        t.lookup(keys)
    # A bad id anywhere in the batch rejects the whole call before any change.
    for bad in (2, -1):
        msg = rf"table id {bad} \(key position 2\) is out of range \[0, 2\)"
        with pytest.raises(RuntimeError, match=msg):
            t.insert(keys, torch.tensor([0, 1, bad]))
        with pytest.raises(RuntimeError, match=msg):
            t.lookup(keys, torch.tensor([0, 1, bad]))
        with pytest.raises(RuntimeError, match=msg):
            t.lookup(keys, torch.tensor([0, 1, bad]), update_score=True)
        with pytest.raises(RuntimeError, match=msg):
            t.erase(keys, torch.tensor([0, 1, bad]))
        with pytest.raises(RuntimeError, match=msg):
            t.take(keys, torch.tensor([0, 1, bad]))
        with pytest.raises(RuntimeError, match=msg):
            ops.table_lookup(table_arg(t), keys, torch.tensor([0, 1, bad]), 16)
    assert t.size() == 0 and not t.slot_digests.any() and not t.counters.any()


def test_take_slot_entries_of_the_wrong_shape(t):
    t.insert(torch.tensor([1, 2, 3]), 0)
    with pytest.raises(RuntimeError, match=r"slot_values must hold 48 slots, got shape \[47\]"):
        t.take(torch.tensor([1]), 0, torch.zeros(47, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="slot_values must be Long, got Int"):
        t.take(torch.tensor([1]), 0, torch.zeros(48, dtype=torch.int32))
    assert t.size() == 3  # nothing erased


def test_length_mismatches(t):
    keys = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"table_ids must be 1-D with one entry per key \(3\), got shape \(2,\)"):
        t.insert(keys, torch.tensor([0, 1]))
    c = ScoredHashTable(32, 16, S.CUSTOMIZED)
    with pytest.raises(ValueError, match=r"scores must be 1-D with one entry per key \(3\), got shape \(4,\)"):
        c.insert(keys, scores=torch.tensor([1, 2, 3, 4]))
    with pytest.raises(TypeError, match="scores must be an int or an integer tensor"):
        c.insert(keys, scores=torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(TypeError, match="STEP scores take one step number"):
        t.insert(keys, 0, scores=torch.tensor([1, 2, 3]))
    # The raw ops check the same.
    with pytest.raises(RuntimeError, match=r"table_ids must be 1-D with one entry per key \(3\), got shape \[2\]"):
        ops.table_lookup(table_arg(t), keys, torch.tensor([0, 1]), 16)
    with pytest.raises(RuntimeError, match=r"scores must be 1-D with one entry per key \(3\), got shape \[1\]"):
        ops.table_insert(table_arg(c), keys, None, torch.tensor([1]), 2, 16, 0, 1)
    with pytest.raises(RuntimeError, match=r"epoch must be in \[1, 255\], got 256"):
        ops.table_insert(table_arg(c), keys, None, None, 2, 16, 0, 256)
    with pytest.raises(RuntimeError, match="slot_epochs"):
        ops.table_insert(table_arg(c, slot_epochs=c.slot_epochs.int()), keys, None, None, 2, 16, 0, 1)
    assert c.size() == 0


def test_capacity_not_a_multiple_of_bucket_capacity():
    with pytest.raises(ValueError, match=r"capacity 40 must be a positive multiple of bucket_capacity \(16\)"):
        ScoredHashTable(40, 16)
    with pytest.raises(ValueError, match=r"table 'b': capacity 0 must be a positive multiple"):
        ScoredHashTable([32, 0], 16, num_tables=2, table_names=["a", "b"])
    # Named, not "'float' object is not iterable"; a numpy integer is an int.
    with pytest.raises(TypeError, match=r"capacity must be an int \(slots per table\) or one per table, got 32.0"):
        ScoredHashTable(32.0, 16)
    with pytest.raises(TypeError, match=r"num_tables must be an int >= 1, got 2.0"):
        ScoredHashTable(32, 16, num_tables=2.0)
    assert ScoredHashTable(np.int64(32), 16).capacity() == 32
    two = ScoredHashTable(np.array([32, 64]), 16, num_tables=np.int64(2))  # numpy integers are ints
    assert two.capacities() == [32, 64] and two.num_tables == 2
    two.grow(np.int64(64), table_id=0)
    assert two.capacities() == [64, 64]


def test_bucket_capacity_not_a_multiple_of_16(t):
    with pytest.raises(ValueError, match="bucket_capacity must be a positive multiple of 16, got 24"):
        ScoredHashTable(48, 24)
    with pytest.raises(ValueError, match="bucket_capacity must be a positive multiple of 16, got 0"):
        ScoredHashTable(48, 0)
    with pytest.raises(RuntimeError, match="bucket_capacity must be a positive multiple of 16, got 8"):
        ops.table_lookup(table_arg(t), torch.tensor([1]), None, 8)


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="the only supported pair is \\(TIMESTAMP, LFU\\)"):
        ScoredHashTable(32, 16, (S.STEP, S.LFU))
    with pytest.raises(ValueError, match="unknown score_strategy 9"):
        ScoredHashTable(32, 16, 9)
    t = ScoredHashTable(32, 16)
    with pytest.raises(ValueError, match="batch_size must be positive"):
        list(t.export(batch_size=0))
    with pytest.raises(RuntimeError, match=r"export range \[0, 64\) is outside \[0, 32\)"):
        ops.table_export_range(table_arg(t), None, 0, 64, 16, 0)
    with pytest.raises(RuntimeError, match="slot_scores must hold 32 slots"):
        ops.table_lookup_refresh(table_arg(t, slot_scores=t.slot_scores[:16]), torch.tensor([1]), None, None, 0, 16,
                                 0)


def test_per_table_methods_refuse_bad_table_ids(t):
    t.insert(torch.tensor([1, 2]), 0)
    for bad in (-1, 2, True):
        for call in (lambda: t.size(bad), lambda: t.capacity(bad), lambda: t.load_factor(bad),
                     lambda: t.get_counters(bad), lambda: t.reset_counters(bad), lambda: list(t.export(table_id=bad)),
                     lambda: t.grow(64, table_id=bad)):
            with pytest.raises(ValueError, match=rf"table id {bad!r} is out of range \[0, 2\)"):
                call()
    assert t.capacities() == [32, 16] and t.get_counters(0)["inserted"] == 2


def test_counters_reset_per_table(t):
    t.insert(torch.tensor([1, 2]), 0)
    t.insert(torch.tensor([3]), 1)
    t.reset_counters(0)
    assert t.get_counters(0)["inserted"] == 0 and t.get_counters(1)["inserted"] == 1
    t.reset_counters()
    assert t.get_counters()["inserted"] == 0


def test_bool_and_complex_per_key_values_are_refused(t):
    keys = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="keys must be an integer tensor"):
        t.insert(torch.tensor([True, False]), 0)
    with pytest.raises(TypeError, match="table_ids must be an int or an integer tensor"):
        t.insert(keys, torch.tensor([True, False]))
    c = ScoredHashTable(32, 16, S.CUSTOMIZED)
    with pytest.raises(TypeError, match="scores must be an int or an integer tensor"):
        c.insert(keys, scores=torch.tensor([1 + 1j, 2 + 0j]))


def test_raw_ops_refuse_a_bad_layout_or_strategy():
    t = ScoredHashTable(32, 16, S.STEP)
    keys = torch.tensor([5])
    args = lambda tb: (table_arg(t, table_buckets=tb), keys, None, None, int(S.STEP), 16, 0)  # noqa: E731
    with pytest.raises(RuntimeError, match="table_buckets must start at 0"):
        ops.table_lookup_refresh(*args(torch.tensor([1, 2])))
    # [0, 2, 2]: table 1 owns no bucket (its keys would land in another's).
    two = ScoredHashTable([16, 16], 16, S.STEP, num_tables=2)
    with pytest.raises(RuntimeError, match="table 1 owns no bucket"):
        ops.table_lookup(table_arg(two, table_buckets=torch.tensor([0, 2, 2])), keys, torch.tensor([1]), 16)
    bad = list(args(t.table_buckets))
    bad[4] = 9
    with pytest.raises(RuntimeError, match="unknown score strategy code 9"):
        ops.table_lookup_refresh(*bad)


generate_opcheck_tests(sys.modules[__name__])


def test_insert_outcome_against_the_results(device):
    # The rule in Python: a key got a new row when INSERTED or EVICTED; the
    # FAILED keys are counted per table id. On random results, then on a
    # real insert's (every kind of result).
    gen = torch.Generator().manual_seed(3)
    results = torch.randint(0, 4, (1000,), generator=gen, dtype=torch.int8)
    tids = torch.randint(0, 5, (1000,), generator=gen)
    t = ScoredHashTable([16, 32], 16, S.STEP, num_tables=2, device=device)
    t.insert(torch.arange(40, device=device), torch.arange(40, device=device) % 2, scores=1)
    keys = torch.cat([torch.arange(30), torch.arange(100, 140)]).to(device)  # 30 found, 40 new: evict, fail
    real = t.insert(keys, keys % 2, scores=2).results
    assert set(real.tolist()) == {int(r) for r in InsertResult}
    for res, ids, n in ((results, tids, 5), (real.cpu(), (keys % 2).cpu(), 2)):
        got_row, failed = ops.table_insert_outcome(res.to(device), ids.to(device), n)
        assert torch.equal(got_row.cpu(), (res == InsertResult.INSERTED) | (res == InsertResult.EVICTED))
        assert torch.equal(failed.cpu(), torch.bincount(ids[res == InsertResult.FAILED], minlength=n))


def test_insert_outcome_refuses_bad_arguments():
    res = torch.tensor([3, 0], dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"table_ids\[0\] = 2 is outside \[0, 2\)"):
        ops.table_insert_outcome(res, torch.tensor([2, 5]), 2)  # only failed keys' ids are counted (and checked)
    with pytest.raises(RuntimeError, match="results must be Char"):
        ops.table_insert_outcome(res.long(), torch.tensor([0, 1]), 2)
    with pytest.raises(RuntimeError, match="results and table_ids must be 1-D of one length"):
        ops.table_insert_outcome(res, torch.tensor([0]), 2)
