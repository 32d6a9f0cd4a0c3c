"""The same model on 1 rank and on 2 ranks (the global batch split across the
ranks) trains identically: outputs of every step and final rows (with the
optimizer state) agree, for EXACT_SGD and ADAM, EBC (SUM, MEAN, weighted)
and EC."""
import pytest
import torch
import torchrec

import models
from dynamicemb.optimizer import EmbOptimType
from multiprocess import run_ranks

TABLES = ["a_table", "b_table"]
FEATURES = [t.replace("table", "feature") for t in TABLES]
BATCH, KEYS, STEPS = 8, 40, 5
OPTIMIZERS = {
    "sgd": dict(optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.1),
    "adam": dict(optimizer=EmbOptimType.ADAM, learning_rate=0.05, eps=1e-3, beta1=0.8, beta2=0.9),
}
MODELS = {  # kind, configs
    "ebc_sum": ("ebc", lambda: models.ebc_configs(TABLES, dim=8, num_embeddings=KEYS)),
    "ebc_mean": ("ebc", lambda: models.ebc_configs(TABLES, dim=8, num_embeddings=KEYS,
                                                   pooling=torchrec.PoolingType.MEAN)),
    "ebc_weighted": ("weighted_ebc", lambda: models.ebc_configs(TABLES, dim=8, num_embeddings=KEYS)),
    "ec": ("ec", lambda: models.ec_configs(TABLES, dim=8, num_embeddings=KEYS)),
}


def _train(kind, configs, pg, fused_params, samples=None):
    """samples: this rank's samples of each global batch (default: an equal share)."""
    model = models.build(kind, configs, pg, models.dynamic_constraints(TABLES), fused_params)
    samples = samples or models.local_samples(BATCH, pg)
    outputs = []
    for step in range(STEPS):
        batch = models.random_batch(FEATURES, BATCH, KEYS, seed=step)
        out = models.resolved(model(models.kjt(batch, samples, kind == "weighted_ebc")))
        outputs.append(out)
        # TorchRec divides the embedding gradients by the world size
        # (comm_ops.set_gradient_division, default on) as if the loss were a
        # mean over ranks; our losses are sums over samples, so each rank's
        # loss is scaled by the world size to apply the 1-rank update.
        (models.loss_of(out) * pg.size()).backward()
    keys = torch.arange(KEYS)
    rows = {t: models.stored_rows(model, t, keys, pg) for t in TABLES}
    return outputs, rows


def _world_sizes(rank, world, cuts=None):
    """cuts: each rank's samples as [cuts[r], cuts[r + 1]) (ranks of unequal
    batch sizes), else equal shares."""
    world_pg, own_pg = models.rank_groups()
    samples = slice(cuts[rank], cuts[rank + 1]) if cuts else models.local_samples(BATCH, world_pg)
    checked = []
    for opt_name, fused in OPTIMIZERS.items():
        for model_name, (kind, configs) in MODELS.items():
            if cuts and (opt_name != "sgd" or kind == "ec"):
                continue  # uneven batches: the EBC's reduce-scatter (an EC's all-to-all takes any sizes)
            if cuts and 0 in (cuts[r + 1] - cuts[r] for r in range(world)) and model_name == "ebc_mean":
                continue  # TorchRec's row-wise MEAN divisor cannot be made for an empty batch (native too)
            what = f"{model_name}/{opt_name}"
            ref_out, ref_rows = _train(kind, configs(), own_pg, fused)
            outs, rows = _train(kind, configs(), world_pg, fused, samples)
            for step, (ref, out) in enumerate(zip(ref_out, outs)):
                # The 1-rank model saw the whole batch: compare this rank's samples.
                mine = models.sample_rows(ref, samples).detach()
                torch.testing.assert_close(models.output_values(out).detach(), mine, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{what} step {step}: {m}")
            for t in TABLES:
                (ref_v, ref_owner), (v, owner) = ref_rows[t], rows[t]
                touched = ref_owner >= 0
                assert bool(touched.any()) and torch.equal(touched, owner >= 0), f"{what} {t}: stored keys differ"
                torch.testing.assert_close(v, ref_v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} {t} rows: {m}")
                # Training moved the rows away from their initial (DEBUG) values.
                initial = touched.nonzero() / 100 + torch.arange(8) / 10000
                assert not torch.allclose(v[touched, :8], initial.to(torch.float64), atol=1e-4), f"{what} {t}: no update"
            checked.append(what)
    return checked


def test_one_rank_equals_two_ranks():
    checked = run_ranks(_world_sizes, 2)
    assert checked[0] == checked[1] and len(checked[0]) == len(OPTIMIZERS) * len(MODELS)


@pytest.mark.parametrize("cuts", [[0, 1, BATCH], [0, 0, BATCH]], ids=["1+7", "0+8"])
def test_ranks_with_unequal_batch_sizes_train_as_one_rank(cuts):
    """A short last batch split unevenly (or a rank with none): on gloo the
    EBC's reduce-scatter of unequal chunks used to fail in its backward
    (TorchRec's all-gathers unequal chunks: NCCL only)."""
    checked = run_ranks(_world_sizes, 2, cuts)
    assert checked[0] == checked[1] and len(checked[0]) == (2 if 0 in cuts[1:] else 3)
