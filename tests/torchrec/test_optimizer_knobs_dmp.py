"""Issue 36's optimizer knobs through TorchRec DMP (our planner and
sharders, fused_params as a TorchRec user passes them) on 1 and on 2 gloo
ranks: PARTIAL_ROWWISE_ADAM, FBGEMM's gradient_clipping / max_gradient, and
initial_accumulator_value. Every rank's rows (with their optimizer state)
after each step equal a float64 Python model of FBGEMM's rules
(tests/optim_reference.py) trained on the whole global batch."""
import torch

import models
from dynamicemb.optimizer import EmbOptimType
from multiprocess import run_ranks
from optim_reference import ReferenceOptimizer

TABLES = ["a_table", "b_table"]
FEATURES = [t.replace("table", "feature") for t in TABLES]
BATCH, KEYS, STEPS, DIM = 8, 40, 4, 8
CONFIGS = {
    "partial_rowwise_adam": dict(optimizer=EmbOptimType.PARTIAL_ROWWISE_ADAM, learning_rate=0.05, eps=1e-3,
                                 beta1=0.8, beta2=0.9, weight_decay=0.01),
    "rowwise_adagrad_clipped_acc": dict(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-3,
                                        gradient_clipping=True, max_gradient=0.5, initial_accumulator_value=0.2),
}


def _debug_row(key: int) -> torch.Tensor:  # the DEBUG initializer (models.dynamic_constraints' default)
    return torch.tensor([(key % 100000) * 0.01 + j * 0.0001 for j in range(DIM)], dtype=torch.float64)


def _reference(fused: dict, batches):
    """{table: ReferenceOptimizer} after training on the global batches with
    loss = sum((out - 0.5)^2) (models.loss_of), and how many gradient
    elements reached the clipping bound."""
    clip = fused.get("max_gradient") if fused.get("gradient_clipping") else None
    refs = {t: ReferenceOptimizer(fused["optimizer"].name, DIM, lr=fused["learning_rate"], eps=fused.get("eps", 1e-8),
                                  beta1=fused.get("beta1", 0.9), beta2=fused.get("beta2", 0.999),
                                  weight_decay=fused.get("weight_decay", 0.0),
                                  initial_accumulator_value=fused.get("initial_accumulator_value", 0.0))
            for t in TABLES}
    clipped, history = 0, []
    for batch in batches:
        for t, f in zip(TABLES, FEATURES):
            ref, grads = refs[t], {}
            for bag in batch[f]:
                for k in bag:
                    if k not in ref.rows:
                        ref.add(k, _debug_row(k))
                out = sum((ref.rows[k][:DIM] for k in bag), torch.zeros(DIM, dtype=torch.float64))
                g = 2 * (out - 0.5)  # the bag's output gradient, clipped before the sums per key (FBGEMM's rule)
                if clip is not None:
                    clipped += int((g.abs() > clip).sum())
                    g = g.clamp(-clip, clip)
                for k in bag:
                    grads[k] = grads.get(k, 0) + g
            ref.step(grads)
        history.append({t: {k: r.clone() for k, r in refs[t].rows.items()} for t in TABLES})
    return history, clipped


def _check(rank, world):
    world_pg, own_pg = models.rank_groups()
    checked = []
    batches = [models.random_batch(FEATURES, BATCH, KEYS, seed=step) for step in range(STEPS)]
    keys = torch.arange(KEYS)
    for name, fused in CONFIGS.items():
        history, clipped = _reference(fused, batches)
        assert "gradient_clipping" not in fused or clipped > 0, f"{name}: no gradient reached the bound"
        for pg in (own_pg, world_pg):
            model = models.build("ebc", models.ebc_configs(TABLES, dim=DIM, num_embeddings=KEYS), pg,
                                 models.dynamic_constraints(TABLES), fused)
            for step, batch in enumerate(batches):
                out = models.resolved(model(models.kjt(batch, models.local_samples(BATCH, pg))))
                # TorchRec divides the gradients by the world size: scale the loss back (test_world_sizes).
                (models.loss_of(out) * pg.size()).backward()
                for t in TABLES:
                    rows, owner = models.stored_rows(model, t, keys, pg)
                    want = history[step][t]
                    assert sorted(want) == (owner >= 0).nonzero().flatten().tolist(), f"{name} {t}: stored keys"
                    got = rows[sorted(want)]
                    torch.testing.assert_close(got, torch.stack([want[k] for k in sorted(want)]), rtol=1e-4,
                                               atol=2e-5, msg=lambda m: f"{name} {pg.size()} ranks {t} step {step}: {m}")
            checked.append(f"{name}/{pg.size()}")
    return checked


def test_knobs_through_dmp_on_one_and_two_ranks():
    checked = run_ranks(_check, 2)
    assert checked[0] == checked[1] and len(checked[0]) == 2 * len(CONFIGS)
