"""Hand-computed training behaviour: SGD updates by occurrence, eval lookups,
scores per strategy, learning-rate changes."""
import pytest
import torch

from dynamicemb import DynamicEmbPoolingMode, DynamicEmbScoreStrategy, EmbOptimType
from emb_helpers import DEBUG_INIT, bags, debug_rows, make_module, random_batch, stored, stored_keys, stored_scores

SUM, MEAN, NONE = DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.MEAN, DynamicEmbPoolingMode.NONE

# Features 0 and 2 share table 0, so a key's occurrences add up across features.
FEATURE_TABLE = [0, 1, 0]
BATCH = [[5, 5, 7], [1], [5, 9, -3, 7, 7],  # feature 0, bags b=0..2
         [2, 2], [], [4, 2],  # feature 1
         [9], [5, 7, 7, 7], [-3]]  # feature 2


def _occurrences(batch):
    """{(table, key): count} and {(table, key): sum of 1/len(bag)} by hand."""
    count, mean_w = {}, {}
    for j, b in enumerate(batch):
        t = FEATURE_TABLE[j // 3]
        for k in b:
            count[(t, k)] = count.get((t, k), 0) + 1
            mean_w[(t, k)] = mean_w.get((t, k), 0.0) + 1.0 / len(b)
    return count, mean_w


@pytest.mark.parametrize("pooling", [SUM, MEAN, NONE], ids=lambda p: p.name)
def test_sgd_all_ones_gradient_moves_rows_by_occurrences(pooling, device):
    dims = [4, 4]
    m = make_module(dims, pooling=pooling, feature_table_map=FEATURE_TABLE, initializer_args=DEBUG_INIT,
                    module_kwargs=dict(learning_rate=1.0), device=device)
    indices, offsets = bags(BATCH, device)
    m(indices, offsets).sum().backward()
    count, mean_w = _occurrences(BATCH)
    for (t, k), c in count.items():
        found, row = stored(m, t, [k])
        assert bool(found.all())
        step = mean_w[(t, k)] if pooling == MEAN else c
        torch.testing.assert_close(row[0], debug_rows([k], dims[t])[0] - step, atol=1e-5, rtol=0)
    assert stored_keys(m, 0) == {k for (t, k) in count if t == 0}
    assert stored_keys(m, 1) == {k for (t, k) in count if t == 1}


def test_learning_rate_change_between_steps(device):
    m = make_module([4], initializer_args=DEBUG_INIT, module_kwargs=dict(learning_rate=1.0), device=device)
    indices, offsets = bags([[3, 3, 8]], device)
    m(indices, offsets).sum().backward()  # key 3: -2, key 8: -1
    m.set_learning_rate(0.25)
    assert m.learning_rate == 0.25
    m(indices, offsets).sum().backward()  # key 3: -0.5, key 8: -0.25
    _, rows = stored(m, 0, [3, 8])
    torch.testing.assert_close(rows, debug_rows([3, 8], 4) - torch.tensor([[2.5], [1.25]]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.ADAM, EmbOptimType.EXACT_ADAGRAD,
                                       EmbOptimType.EXACT_ROWWISE_ADAGRAD], ids=lambda o: o.name)
@pytest.mark.parametrize("pooling", [SUM, MEAN, NONE], ids=lambda p: p.name)
def test_eval_forward_reads_stored_rows_and_inserts_nothing(optimizer, pooling, device):
    gen = torch.Generator().manual_seed(3)
    m = make_module([8, 8], pooling=pooling, optimizer=optimizer, feature_table_map=[0, 1, 0], device=device)
    for _ in range(5):
        indices, offsets = random_batch(gen, [0, 1, 0], [40, 40], batch=4, max_len=4, device=device)
        out = m(indices, offsets)
        (out * torch.randn(out.shape, generator=gen).to(device)).sum().backward()
    stats = m.table_stats()
    # Keys 0..39 were seen (mostly), 1000.. never: eval gives their eval
    # initial value (zeros) and stores nothing.
    indices, offsets = random_batch(gen, [0, 1, 0], [40, 40], batch=4, max_len=4)
    indices = torch.where(torch.rand(indices.shape, generator=gen) < 0.3, indices + 1000, indices)
    assert bool((indices >= 1000).any()) and bool((indices < 1000).any())
    m.eval()
    out_eval = m(indices.to(device), offsets.to(device)).cpu()
    assert m.table_stats() == stats
    m.train()
    # Reference: stored rows for stored keys, zeros for missing ones, pooled by hand.
    table_of = [[0, 1, 0][j // 4] for j in range(len(offsets) - 1)]
    rows = []
    for j in range(len(offsets) - 1):
        ks = indices[offsets[j]:offsets[j + 1]]
        found, r = stored(m, table_of[j], ks)
        r = r[:, :8] * found[:, None]
        rows.append(r)
    if pooling == NONE:
        expected = torch.cat(rows)
    else:
        pooled = [r.sum(0) / (max(len(r), 1) if pooling == MEAN else 1) for r in rows]
        expected = torch.stack([torch.cat([pooled[f * 4 + b] for f in range(3)]) for b in range(4)])
    torch.testing.assert_close(out_eval, expected, atol=1e-6, rtol=0)


def test_eval_forward_then_train_forward_on_stored_keys_agree(device):
    gen = torch.Generator().manual_seed(5)
    m = make_module([6], pooling=SUM, optimizer=EmbOptimType.EXACT_ADAGRAD, device=device)
    for _ in range(3):
        indices, offsets = random_batch(gen, [0], [20], batch=8, max_len=5, min_len=1, device=device)
        m(indices, offsets).sum().backward()
    keys = sorted(stored_keys(m, 0))
    indices, offsets = bags([keys[i::3] for i in range(3)], device)
    m.eval()
    out_eval = m(indices, offsets)
    m.train()
    out_train = m(indices, offsets)
    assert not torch.equal(out_eval, torch.zeros_like(out_eval))
    torch.testing.assert_close(out_train.detach(), out_eval, atol=0, rtol=0)


def test_missing_keys_in_eval_read_eval_initializer_and_are_not_inserted(device):
    m = make_module([4], initializer_args=DEBUG_INIT, device=device)
    indices, offsets = bags([[1, 2], [3]], device)
    m(indices, offsets).sum().backward()
    before = m.table_stats()
    m.eval()
    out = m(*bags([[1, 100], [200, 300]], device)).cpu()
    assert m.table_stats() == before and stored_keys(m, 0) == {1, 2, 3}
    _, row1 = stored(m, 0, [1])
    torch.testing.assert_close(out[0], row1[0], atol=0, rtol=0)
    torch.testing.assert_close(out[1], torch.zeros(4), atol=0, rtol=0)


# ---- scores -----------------------------------------------------------------------------


def test_step_scores_follow_the_module_step(device):
    m = make_module([4], score_strategy=DynamicEmbScoreStrategy.STEP, device=device)
    for keys in ([1, 2, 3], [2, 3], [3, 4]):
        m(*bags([keys], device)).sum().backward()
    assert m.step == 3
    assert stored_scores(m, 0) == {1: 1, 2: 2, 3: 3, 4: 3}
    m.eval()
    m(*bags([[1, 2]], device))  # eval lookups do not touch scores
    assert stored_scores(m, 0) == {1: 1, 2: 2, 3: 3, 4: 3}


def test_customized_scores_come_from_set_score(device):
    m = make_module([4, 4], feature_table_map=[0, 1], score_strategy=DynamicEmbScoreStrategy.CUSTOMIZED,
                    device=device)
    m.set_score(10)
    m(*bags([[1, 2], [1]], device)).sum().backward()
    m.set_score(25, table_id=1)
    m(*bags([[2], [1, 5]], device)).sum().backward()
    assert stored_scores(m, 0) == {1: 10, 2: 10}
    assert stored_scores(m, 1) == {1: 25, 5: 25}


@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.LFU,
                                      (DynamicEmbScoreStrategy.TIMESTAMP, DynamicEmbScoreStrategy.LFU)],
                         ids=["LFU", "TIMESTAMP_LFU"])
def test_lfu_scores_count_occurrences(strategy, device):
    m = make_module([4], score_strategy=strategy, device=device)
    m(*bags([[1, 1, 2], [1]], device)).sum().backward()
    m(*bags([[2], [3, 1]], device)).sum().backward()
    assert stored_scores(m, 0) == {1: 4, 2: 2, 3: 1}


# ---- weight decay and determinism -------------------------------------------------------


@pytest.mark.parametrize("optimizer,mode", [(EmbOptimType.ADAM, None),
                                            (EmbOptimType.EXACT_ROWWISE_ADAGRAD, "L2"),
                                            (EmbOptimType.EXACT_ROWWISE_ADAGRAD, "DECOUPLE")],
                         ids=["ADAM", "ROWWISE_L2", "ROWWISE_DECOUPLE"])
def test_weight_decay_by_hand(optimizer, mode, device):
    # FBGEMM's (GPU) rules: Adam adds weight_decay * w to the update (not to
    # the moments); rowwise Adagrad with L2 decays the gradient that enters
    # the state and scales the old weight by 1 - multiplier * wd; with
    # DECOUPLE the state sees the plain gradient and the old weight is scaled
    # by 1 - lr * wd. (FBGEMM's CPU TBE ignores weight decay, so the rule is
    # checked by hand.) Two steps: the second starts from decayed state.
    lr, wd, eps, b1, b2 = 0.1, 0.5, 1e-8, 0.9, 0.999
    m = make_module([3], optimizer=optimizer, initializer_args=DEBUG_INIT,
                    module_kwargs=dict(learning_rate=lr, weight_decay=wd, weight_decay_mode=mode, eps=eps,
                                       beta1=b1, beta2=b2), device=device)
    w = debug_rows([42], 3)[0]
    m1 = m2 = acc = torch.zeros(3)
    for step, g in enumerate([torch.ones(3), torch.tensor([0.5, -2.0, 1.5])], start=1):
        (m(*bags([[42]], device)) * g.to(device)).sum().backward()
        if optimizer == EmbOptimType.ADAM:
            m1, m2 = b1 * m1 + (1 - b1) * g, b2 * m2 + (1 - b2) * g * g
            w = w - lr * ((m1 / (1 - b1**step)) / ((m2 / (1 - b2**step)).sqrt() + eps) + wd * w)
            state = torch.cat([m1, m2])
        else:
            gs = g + wd * w if mode == "L2" else g
            acc = acc + (gs * gs).mean()
            mult = lr / (acc[:1].sqrt() + eps)
            corr = 1 - mult * wd if mode == "L2" else 1 - lr * wd
            w = corr * w - mult * g
            state = acc[:1]
    _, row = stored(m, 0, [42])
    torch.testing.assert_close(row[0, :3], w, atol=1e-6, rtol=0)
    torch.testing.assert_close(row[0, 3:], state, atol=1e-6, rtol=1e-6)


def test_weight_decay_that_fbgemm_ignores_is_refused():
    wd = dict(weight_decay=0.1)
    for opt in (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD):
        with pytest.raises(ValueError, match=f"{opt.name} has no weight decay"):
            make_module([4], optimizer=opt, module_kwargs=wd)
    with pytest.raises(ValueError, match="weight_decay_mode NONE"):
        make_module([4], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, module_kwargs=wd)
    with pytest.raises(ValueError, match="EXACT_ROWWISE_ADAGRAD only"):
        make_module([4], optimizer=EmbOptimType.ADAM, module_kwargs=dict(weight_decay_mode="L2"))
    with pytest.raises(ValueError, match="not supported"):
        make_module([4], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                    module_kwargs=dict(weight_decay=0.1, weight_decay_mode="COUNTER"))
    make_module([4], optimizer=EmbOptimType.ADAM, module_kwargs=wd)  # Adam's decay needs no mode


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD],
                         ids=lambda o: o.name)
def test_results_do_not_depend_on_thread_count(optimizer):
    def run(threads):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            gen = torch.Generator().manual_seed(17)
            m = make_module([8, 4], optimizer=optimizer, feature_table_map=[0, 1, 0], max_capacity=1 << 14)
            outs = []
            for _ in range(3):  # ~6000 indices: every parallel path is taken
                indices, offsets = random_batch(gen, [0, 1, 0], [3000, 500], batch=500, max_len=8)
                out = m(indices, offsets)
                (out * torch.randn(out.shape, generator=gen)).sum().backward()
                outs.append(out.detach())
            return outs, [stored(m, t, torch.arange(n))[1] for t, n in ((0, 3000), (1, 500))]
        finally:
            torch.set_num_threads(prev)

    outs1, rows1 = run(1)
    outs2, rows2 = run(2)
    for a, b in zip(outs1 + rows1, outs2 + rows2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pooling", [SUM, MEAN], ids=lambda p: p.name)
def test_per_sample_weight_gradient_by_hand(pooling, device):
    # d loss / d weight_i = <row_i before the update, gradient of its bag> (/ bag length for MEAN).
    m = make_module([2, 3], pooling=pooling, initializer_args=DEBUG_INIT, module_kwargs=dict(learning_rate=1.0),
                    device=device)
    indices, offsets = bags([[1, 2], [3], [4, 5, 4], []], device)  # F = 2, B = 2
    psw = torch.tensor([0.5, 2.0, -1.0, 1.0, 3.0, 0.25], device=device, requires_grad=True)
    probe = torch.tensor([[1.0, -2.0, 0.5, 1.0, 2.0], [3.0, 1.0, -1.0, 0.0, 4.0]])
    (m(indices, offsets, psw) * probe.to(device)).sum().backward()
    r = {k: debug_rows([k], 2 if k < 4 else 3)[0] for k in (1, 2, 3, 4, 5)}
    g = [probe[0, :2], probe[0, :2], probe[1, :2], probe[0, 2:], probe[0, 2:], probe[0, 2:]]
    lens = [2, 2, 1, 3, 3, 3] if pooling == MEAN else [1] * 6
    expected = torch.stack([(r[k] * gi).sum() / n for k, gi, n in zip([1, 2, 3, 4, 5, 4], g, lens)])
    torch.testing.assert_close(psw.grad.cpu(), expected, atol=1e-5, rtol=0)
