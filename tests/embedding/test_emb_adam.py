"""ADAM against torch.optim.SparseAdam over nn.EmbeddingBag(sparse=True):
FBGEMM's Adam is lazy like SparseAdam (only rows in the batch move, one global
step count), and FBGEMM's CPU TBE has no Adam to compare with."""
import pytest
import torch
from torch import nn

from dynamicemb import DynamicEmbPoolingMode, EmbOptimType
from emb_helpers import make_module, random_batch, stored

NUM_KEYS = [30, 45]
DIMS = [4, 8]
LR, BETA1, BETA2, EPS = 0.02, 0.8, 0.95, 1e-8


def _reference(mode, gen):
    bags_ = [nn.EmbeddingBag(n, d, mode=mode, sparse=True) for n, d in zip(NUM_KEYS, DIMS)]
    for b in bags_:
        with torch.no_grad():
            b.weight.copy_(torch.rand(b.weight.shape, generator=gen) - 0.5)
    opt = torch.optim.SparseAdam([b.weight for b in bags_], lr=LR, betas=(BETA1, BETA2), eps=EPS)
    return bags_, opt


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True)])
def test_adam_matches_sparse_adam(mode, weighted):
    gen = torch.Generator().manual_seed(7)
    ref, opt = _reference(mode, gen)
    ours = make_module(DIMS, pooling=DynamicEmbPoolingMode[mode.upper()], optimizer=EmbOptimType.ADAM,
                       max_capacity=256,
                       module_kwargs=dict(learning_rate=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0))
    for t, b in enumerate(ref):
        ours.storage.insert_rows(t, torch.arange(NUM_KEYS[t]), b.weight.detach().clone())
    B = 5
    for step in range(10):
        # min_len=1: every table gets a gradient each step, as every feature
        # does in TBE batches (SparseAdam counts steps per parameter).
        indices, offsets = random_batch(gen, [0, 1], NUM_KEYS, batch=B, max_len=4, min_len=1)
        psw = torch.rand(indices.numel(), generator=gen) if weighted else None
        outs = []
        for t, b in enumerate(ref):
            lo, hi = offsets[t * B], offsets[(t + 1) * B]
            outs.append(b(indices[lo:hi], offsets[t * B:(t + 1) * B] - lo,
                          per_sample_weights=None if psw is None else psw[lo:hi]))
        out_ref = torch.cat(outs, dim=1)
        out = ours(indices, offsets, per_sample_weights=psw)
        torch.testing.assert_close(out, out_ref.detach(), atol=1e-5, rtol=0)
        probe = torch.randn(out.shape, generator=gen)
        opt.zero_grad()
        (out_ref * probe).sum().backward()
        opt.step()
        (out * probe).sum().backward()
        for t, b in enumerate(ref):
            _, rows = stored(ours, t, torch.arange(NUM_KEYS[t]))
            torch.testing.assert_close(rows[:, : DIMS[t]], b.weight.detach(), atol=1e-5, rtol=0)
            # State layout [m1 (dim) | m2 (dim)], SparseAdam's exp_avg / exp_avg_sq.
            st = opt.state[b.weight]
            torch.testing.assert_close(rows[:, DIMS[t]: 2 * DIMS[t]], st["exp_avg"], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(rows[:, 2 * DIMS[t]:], st["exp_avg_sq"], atol=1e-6, rtol=1e-5)
    assert ours.optimizer_step == 10
