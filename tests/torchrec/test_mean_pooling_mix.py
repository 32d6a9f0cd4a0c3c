"""A dynamic MEAN table beside native tables in one EmbeddingBagCollection.
A dynamic table is row-wise: it pools as SUM on each rank, and TorchRec's
mean-pooling callback divides the collection's output afterwards. That
callback divided the native table-wise tables' outputs too (a SUM table came
out averaged, a MEAN table divided twice), silently. Checked against the same
collection of native table-wise tables, which pool in their kernel."""
import torch
import torchrec
from torchrec.distributed.planner import ParameterConstraints

import models
from multiprocess import run_ranks

KEYS, BATCH, STEPS, DIM = 40, 8, 3, 4
MEAN, SUM = torchrec.PoolingType.MEAN, torchrec.PoolingType.SUM


def _config(name, feature, pooling):
    return torchrec.EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=KEYS, feature_names=[feature],
                                       pooling=pooling)


CONFIGS = [_config("d_table", "d_feature", MEAN), _config("s_table", "s_feature", SUM),
           _config("m_table", "m_feature", MEAN)]
DYNAMIC = ["d_table"]


def _mixed(configs, pg):
    constraints = models.dynamic_constraints(DYNAMIC)
    for c in configs:
        if c.name not in DYNAMIC:
            constraints[c.name] = ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
    return models.build("ebc", configs, pg, constraints, models.SGD, collective=True)


def _mixed_against_native(rank, world):
    """Per feature, the largest output difference over the training steps,
    and per table the largest row difference after them (plain floats)."""
    pg = models.rank_groups()[0]
    start = models.initial_weights(CONFIGS, seed=3)
    mixed, native = _mixed(CONFIGS, pg), models.native_model(CONFIGS, pg, models.SGD)
    for c in CONFIGS:
        models.set_native_rows(native, models.weight_fqn("ebc", c.name), start[c.name])
        if c.name in DYNAMIC:
            models.set_dynamic_rows(mixed, c.name, start[c.name], pg)
        else:
            models.set_native_rows(mixed, models.weight_fqn("ebc", c.name), start[c.name])
    features = [c.feature_names[0] for c in CONFIGS]
    outputs = dict.fromkeys(features, 0.0)
    samples = models.local_samples(BATCH, pg)
    for step in range(STEPS):
        kjt = models.kjt(models.random_batch(features, BATCH, KEYS, seed=70 + step, max_len=4), samples)
        got, ref = models.resolved(mixed(kjt)), models.resolved(native(kjt))
        for f in features:
            outputs[f] = max(outputs[f], float((got[f] - ref[f]).abs().max()))
        models.loss_of(got).backward()
        models.loss_of(ref).backward()
    rows = {}
    for c in CONFIGS:
        trained = models.native_rows(native, models.weight_fqn("ebc", c.name), pg)
        if c.name in DYNAMIC:
            held, owner = models.stored_rows(mixed, c.name, torch.arange(KEYS), pg)
            assert bool((owner >= 0).all())
            rows[c.name] = float((held[:, :DIM] - trained).abs().max())
        else:
            rows[c.name] = float((models.native_rows(mixed, models.weight_fqn("ebc", c.name), pg) - trained).abs().max())
    return outputs, rows


def test_native_tables_beside_a_dynamic_mean_table_keep_their_pooling():
    for outputs, rows in run_ranks(_mixed_against_native, 2):
        # Without the fix: the SUM table's outputs differ by up to ~0.5 (averaged).
        assert max(outputs.values()) < 1e-5, outputs
        assert max(rows.values()) < 1e-5, rows


def _shared_feature_refusal(rank, world):
    pg = models.rank_groups()[0]
    configs = [_config("d_table", "f", MEAN), _config("s_table", "f", SUM)]
    try:
        _mixed(configs, pg)
    except ValueError as e:
        return str(e)
    return None


def test_a_feature_read_by_a_dynamic_mean_table_and_another_table_is_refused():
    msg = run_ranks(_shared_feature_refusal, 1)[0]
    assert msg is not None and "'f' (MEAN table 'd_table', table 's_table')" in msg, msg


def _weighted_mean(rank, world):
    """A weighted dynamic MEAN table's output and, from the same rows, TorchRec's
    row-wise rule computed here: sum(w * row) / (sum(w) + 1e-6) per bag (plain lists)."""
    pg = models.rank_groups()[0]
    configs = [_config("d_table", "d_feature", MEAN)]
    start = models.initial_weights(configs, seed=4)
    model = models.build("weighted_ebc", configs, pg, models.dynamic_constraints(DYNAMIC), models.SGD)
    models.set_dynamic_rows(model, "d_table", start["d_table"], pg)
    batch = models.random_batch(["d_feature"], BATCH, KEYS, seed=9, max_len=4)
    kjt = models.kjt(batch, models.local_samples(BATCH, pg), weighted=True)
    got = models.resolved(model(kjt))["d_feature"]
    offsets, keys, w = kjt.offsets(), kjt.values(), kjt.weights()
    want = torch.zeros_like(got)
    for b in range(offsets.numel() - 1):
        s, e = int(offsets[b]), int(offsets[b + 1])
        want[b] = (w[s:e, None] * start["d_table"][keys[s:e]]).sum(0) / (w[s:e].sum() + 1e-6)
    return got.tolist(), want.tolist(), [float(x) for x in w]


def test_a_weighted_dynamic_mean_bag_divides_by_its_weights():
    got, want, weights = run_ranks(_weighted_mean, 1)[0]
    assert len(set(weights)) > 1  # weights that differ: a divisor by length would not match
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6), (got, want)
