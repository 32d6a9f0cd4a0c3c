"""A user storage that implements the storage protocol (dense_storage.py)
trains, dumps, loads, dumps incrementally and exports like the built-in one:
every step, dump, load and served batch is compared with a module on the
default HashTableStorage (STEP scores, room for every key: no eviction), an
independent reference. One with the training protocol alone trains but is
refused by name by every checkpoint path, before anything is written."""
import os

import pytest
import torch

from dense_storage import DenseStorage, TrainingOnlyStorage
from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbScoreStrategy, DynamicEmbTableOptions,
                        EmbOptimType)
from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad
from dynamicemb.incremental_dump import incremental_dump
from dynamicemb.inference import to_inference
from dynamicemb.optimizer import state_width
from dynamicemb.storage_protocol import CHECKPOINT_METHODS, missing_checkpoint_methods

ROWS = 512
DIMS = (8, 4)
NAMES = ("user_a", "user_b")


def _options():
    return [DynamicEmbTableOptions(dim=d, max_capacity=ROWS, init_capacity=ROWS, num_embeddings=ROWS,
                                   score_strategy=DynamicEmbScoreStrategy.STEP) for d in DIMS]


def _module(storage_cls=None, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD):
    opts = _options()
    code = {EmbOptimType.EXACT_SGD: 0, EmbOptimType.EXACT_ROWWISE_ADAGRAD: 3, EmbOptimType.EXACT_ADAGRAD: 2}[optimizer]
    storage = None if storage_cls is None else storage_cls(
        NAMES, opts, [state_width(code, d) for d in DIMS], torch.float32, seed=7)
    return BatchedDynamicEmbeddingTables(opts, table_names=NAMES, optimizer=optimizer, learning_rate=0.1,
                                         seed=7, storage=storage)


def _batch(i):
    g = torch.Generator().manual_seed(i)
    lengths = torch.randint(0, 5, (2 * 6,), generator=g)
    indices = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return indices, offsets


def _train(m, steps, first=0):
    outs = []
    for i in range(first, first + steps):
        out = m(*_batch(i))
        (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out).sin()).sum().backward()
        outs.append(out.detach())
    return outs


def _eval(m, i=100):
    m.eval()
    try:
        with torch.no_grad():
            return m(*_batch(i))
    finally:
        m.train()


def _entries(m, t):
    """(keys, rows) of table t sorted by key, through the module's find (not
    the export path under test)."""
    keys = torch.arange(ROWS)
    rows = m.storage.find(keys, torch.full_like(keys, t))
    keep = rows >= 0
    return keys[keep], m.storage.weights()[t][rows[keep]]


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD])
def test_a_user_storage_trains_as_the_hash_table_does(optimizer):
    user, ref = _module(DenseStorage, optimizer), _module(None, optimizer)
    for a, b in zip(_train(user, 6), _train(ref, 6)):
        assert torch.equal(a, b)
    assert torch.equal(_eval(user), _eval(ref))
    for t in range(2):
        ku, ru = _entries(user, t)
        kr, rr = _entries(ref, t)
        assert torch.equal(ku, kr) and torch.equal(ru, rr)  # values and optimizer state


def test_a_user_storage_dumps_and_loads_both_ways(tmp_path):
    user, ref = _module(DenseStorage), _module(None)
    _train(user, 5)
    _train(ref, 5)
    DynamicEmbDump(str(tmp_path / "user"), user)
    # Its dump loads into the built-in storage, and the built-in one's into it.
    into_ref, into_user = _module(None), _module(DenseStorage)
    DynamicEmbLoad(str(tmp_path / "user"), into_ref)
    DynamicEmbDump(str(tmp_path / "ref"), ref)
    DynamicEmbLoad(str(tmp_path / "ref"), into_user)
    expected = _eval(ref)
    for m in (user, into_ref, into_user):
        assert torch.equal(_eval(m), expected)
    for t in range(2):
        k, r = _entries(ref, t)
        for m in (into_ref, into_user):
            km, rm = _entries(m, t)
            assert torch.equal(km, k) and torch.equal(rm, r)
    # Training goes on identically from the loaded state (optimizer state and step restored).
    for a, b in zip(_train(into_user, 3, first=5), _train(ref, 3, first=5)):
        assert torch.equal(a, b)


def test_a_user_storage_dumps_incrementally_as_the_hash_table_does():
    user, ref = _module(DenseStorage), _module(None)
    _train(user, 4)
    _train(ref, 4)
    got, nxt = incremental_dump(user, 2)  # STEP: keys touched at step >= 2
    want, want_nxt = incremental_dump(ref, 2)
    assert nxt == want_nxt
    for name in NAMES:
        gk, gv = got[name]
        wk, wv = want[name]
        go, wo = gk.argsort(), wk.argsort()
        assert gk.numel() > 0 and torch.equal(gk[go], wk[wo]) and torch.equal(gv[go], wv[wo])


def test_a_user_storage_exports_for_serving():
    user = _module(DenseStorage)
    _train(user, 4)
    served = to_inference(user)
    indices, offsets = _batch(100)
    assert torch.equal(served(indices, offsets), _eval(user))


def test_a_training_only_storage_trains_but_every_checkpoint_path_refuses_it(tmp_path):
    m = _module(TrainingOnlyStorage)
    _train(m, 2)  # trains
    assert missing_checkpoint_methods(m.storage) == ["strategy", "now", "export_rows", "load_rows"]
    assert missing_checkpoint_methods(_module(DenseStorage).storage) == []
    assert set(missing_checkpoint_methods(_module(None).storage)) == set()
    for call, what in ((lambda: DynamicEmbDump(str(tmp_path / "d"), m), "DynamicEmbDump"),
                       (lambda: DynamicEmbLoad(str(tmp_path / "d"), m), "DynamicEmbLoad"),
                       (lambda: incremental_dump(m, 0), "incremental_dump"),
                       (lambda: to_inference(m), "to_inference")):
        with pytest.raises(TypeError) as e:
            call()
        msg = str(e.value)
        assert what in msg and "user_a" in msg and "TrainingOnlyStorage" in msg and "export_rows" in msg
    assert not os.path.exists(tmp_path / "d")  # refused before writing anything
    with pytest.raises(NotImplementedError, match="checkpoint protocol"):
        m.storage.export_rows(0)
    assert set(CHECKPOINT_METHODS) >= {"export_rows", "load_rows", "clear_table"}
