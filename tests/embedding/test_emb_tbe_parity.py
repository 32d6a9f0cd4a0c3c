"""Numerical parity with FBGEMM's CPU TBE (SplitTableBatchedEmbeddingBagsCodegen,
HOST / CPU): same initial rows, same batches, same loss; outputs, updated rows
and optimizer states must agree after every step."""
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice, EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
)
from emb_helpers import make_module, random_batch, stored

NUM_KEYS = [50, 70, 40]
# Table 0 is read by two features. FBGEMM's CPU backward requires the
# features of a shared table to be adjacent, as TorchRec always lays them out.
FEATURE_TABLE = [0, 0, 1, 2]
LR, EPS = 0.05, 1e-3
OPTIMIZERS = [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD]
CONFIGS = [  # (pooling, dims): mixed dims only with pooling (TBE refuses them with NONE)
    ("SUM", [4, 4, 4]),
    ("SUM", [4, 8, 12]),
    ("MEAN", [8, 8, 8]),
    ("MEAN", [4, 8, 12]),
    ("NONE", [8, 8, 8]),
]


def _pair(optimizer, pooling: str, dims, per_table=None, num_keys=NUM_KEYS, capacity=256):
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(n, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for n, d in zip(num_keys, dims)],
        feature_table_map=FEATURE_TABLE, optimizer=optimizer, learning_rate=LR, eps=EPS,
        pooling_mode=PoolingMode[pooling])
    opts = [DynamicEmbTableOptions(**{"dim": d, "max_capacity": capacity, "bucket_capacity": 16, **kw})
            for d, kw in zip(dims, per_table or [{}] * len(dims))]
    ours = BatchedDynamicEmbeddingTables(opts, feature_table_map=FEATURE_TABLE,
                                         pooling_mode=DynamicEmbPoolingMode[pooling], optimizer=optimizer,
                                         learning_rate=LR, eps=EPS)
    for t, w in enumerate(tbe.split_embedding_weights()):
        rows = ours.storage.insert_rows(t, torch.arange(num_keys[t]), w.clone())
        assert bool((rows >= 0).all())
    return tbe, ours


def _tbe_state(tbe, optimizer, t, num_keys):
    if optimizer == EmbOptimType.EXACT_SGD:
        return None
    s = tbe.split_optimizer_states()[t][0]
    return s.reshape(num_keys[t], -1)  # ADAGRAD [N, D]; ROWWISE [N] -> [N, 1]


def _check_rows(tbe, ours, optimizer, dims, num_keys):
    for t, w in enumerate(tbe.split_embedding_weights()):
        found, rows = stored(ours, t, torch.arange(num_keys[t]))
        assert bool(found.all())
        torch.testing.assert_close(rows[:, : dims[t]], w, atol=1e-5, rtol=0)
        state = _tbe_state(tbe, optimizer, t, num_keys)
        if state is not None:
            assert rows.shape[1] - dims[t] == state.shape[1]
            torch.testing.assert_close(rows[:, dims[t]:], state, atol=1e-5, rtol=1e-5)


def _train(tbe, ours, optimizer, dims, weighted=False, steps=10, lr_schedule=None, batch=6, max_len=5,
           num_keys=NUM_KEYS):
    gen = torch.Generator().manual_seed(1234)
    initial = [w.clone() for w in tbe.split_embedding_weights()]
    for step in range(steps):
        if lr_schedule and step in lr_schedule:
            tbe.set_learning_rate(lr_schedule[step])
            ours.set_learning_rate(lr_schedule[step])
        indices, offsets = random_batch(gen, FEATURE_TABLE, num_keys, batch=batch, max_len=max_len)
        psw = torch.rand(indices.numel(), generator=gen) * 2 - 0.5 if weighted else None
        # Separate leaves: each module's gradient w.r.t. the weights (learned
        # position weights in TorchRec) is compared too.
        psw_ref, psw_ours = (None, None) if psw is None else (psw.clone().requires_grad_(), psw.clone().requires_grad_())
        out_ref = tbe(indices, offsets, per_sample_weights=psw_ref)
        out = ours(indices, offsets, per_sample_weights=psw_ours)
        assert out.shape == out_ref.shape
        torch.testing.assert_close(out, out_ref.detach(), atol=1e-5, rtol=0)
        probe = torch.randn(out.shape, generator=gen)
        (out_ref * probe).sum().backward()
        (out * probe).sum().backward()
        if weighted:
            assert psw_ours.grad is not None, "no gradient w.r.t. per_sample_weights"
            torch.testing.assert_close(psw_ours.grad, psw_ref.grad, atol=1e-5, rtol=0)
        _check_rows(tbe, ours, optimizer, dims, num_keys)
    # Training really happened (else parity would be vacuous).
    moved = [not torch.equal(a, b) for a, b in zip(initial, tbe.split_embedding_weights())]
    assert all(moved)


@pytest.mark.parametrize("pooling,dims", CONFIGS, ids=[f"{p}-{'x'.join(map(str, d))}" for p, d in CONFIGS])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_parity(optimizer, pooling, dims):
    tbe, ours = _pair(optimizer, pooling, dims)
    _train(tbe, ours, optimizer, dims)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_parity_weighted_sum(optimizer):
    dims = [4, 8, 12]
    tbe, ours = _pair(optimizer, "SUM", dims)
    _train(tbe, ours, optimizer, dims, weighted=True)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_learning_rate_change_takes_effect(optimizer):
    dims = [4, 8, 12]
    tbe, ours = _pair(optimizer, "SUM", dims)
    _train(tbe, ours, optimizer, dims, steps=6, lr_schedule={2: 0.2, 4: 0.01})
    assert ours.learning_rate == 0.01


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_parity_large_batch(optimizer):
    # ~6000 indices: the parallel unique (hash parts) and many occurrences per key.
    dims = [4, 8, 12]
    tbe, ours = _pair(optimizer, "SUM", dims)
    _train(tbe, ours, optimizer, dims, steps=3, batch=400, max_len=7)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_parity_many_keys_updated_in_row_order(optimizer):
    # Thousands of unique keys per batch: the module renumbers them in the
    # order of their rows (emb_order_by_row) before the forward and backward.
    dims, num_keys = [4, 8, 12], [6000, 5000, 4000]
    tbe, ours = _pair(optimizer, "SUM", dims, num_keys=num_keys, capacity=16384)
    _train(tbe, ours, optimizer, dims, steps=2, batch=800, max_len=6, num_keys=num_keys)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_parity_tables_in_separate_hash_tables(optimizer):
    # Other score strategies / bucket capacities: one physical hash table per
    # table, so keys are split between them and the rows merged back.
    dims = [4, 8, 12]
    S = DynamicEmbScoreStrategy
    per_table = [dict(score_strategy=S.STEP), dict(score_strategy=S.LFU, bucket_capacity=32), dict()]
    tbe, ours = _pair(optimizer, "MEAN", dims, per_table)
    assert len(ours.storage.groups) == 3
    _train(tbe, ours, optimizer, dims)


def test_none_pooling_refuses_mixed_dims_like_tbe():
    specs = [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU), (10, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)]
    with pytest.raises(AssertionError, match="Mixed dimension"):
        SplitTableBatchedEmbeddingBagsCodegen(specs, pooling_mode=PoolingMode.NONE)
    with pytest.raises(ValueError, match="pooling NONE needs one dim"):
        make_module([4, 8], pooling=DynamicEmbPoolingMode.NONE)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_parity_shared_table_features_not_adjacent(optimizer):
    # Our feature order [A, B, C, D] with A and D reading table 0; the TBE
    # gets the same bags in its required order [A, D, B, C].
    dims, B = [4, 8, 12], 5
    tbe, _ = _pair(optimizer, "SUM", dims)
    ours = make_module(dims, optimizer=optimizer, feature_table_map=[0, 1, 2, 0], max_capacity=256,
                       module_kwargs=dict(learning_rate=LR, eps=EPS))
    for t, w in enumerate(tbe.split_embedding_weights()):
        ours.storage.insert_rows(t, torch.arange(NUM_KEYS[t]), w.clone())
    order = [0, 3, 1, 2]  # TBE feature i is our feature order[i]
    cols = {0: range(0, 4), 1: range(4, 12), 2: range(12, 24), 3: range(24, 28)}  # our output columns
    perm = [c for f in order for c in cols[f]]
    gen = torch.Generator().manual_seed(99)
    for _ in range(8):
        feats = [[torch.randint(0, NUM_KEYS[t], (int(torch.randint(0, 5, (1,), generator=gen)),), generator=gen)
                  for _ in range(B)] for t in [0, 1, 2, 0]]

        def inputs(fs):
            flat = [b for f in fs for b in f]
            lengths = torch.tensor([len(b) for b in flat])
            return torch.cat(flat), torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])

        out = ours(*inputs(feats))
        out_ref = tbe(*inputs([feats[f] for f in order]))
        torch.testing.assert_close(out[:, perm], out_ref.detach(), atol=1e-5, rtol=0)
        probe = torch.randn(out.shape, generator=gen)
        (out * probe).sum().backward()
        (out_ref * probe[:, perm]).sum().backward()
        _check_rows(tbe, ours, optimizer, dims, NUM_KEYS)
