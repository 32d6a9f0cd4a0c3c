"""Dynamic tables against native ones. Started from the same rows (the native
table's rows stored for every key 0..N-1) and fed the same batches, a dynamic
table trains exactly like TorchRec's FUSED CPU kernel while nothing is evicted
(EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD); ADAM, which TorchRec's CPU
kernels lack, matches torch.optim.SparseAdam on 1 and 2 ranks, with hybrid
tables too (rows in two parts); MEAN pooling
on 2 ranks matches nn.EmbeddingBag(mode="mean") with SGD; a collection
mixing a native FUSED table with dynamic tables matches the pure-native model,
and so does a table that feeds two features."""
import torch
import torchrec
from torch import nn
from torchrec.distributed.planner import ParameterConstraints

import dynamicemb
import models
from dynamicemb.optimizer import EmbOptimType
from multiprocess import run_ranks

TABLES = ["a_table", "b_table"]
FEATURES = [t.replace("table", "feature") for t in TABLES]
DIMS = {"a_table": 8, "b_table": 4}
BATCH, KEYS, STEPS = 8, 48, 5
FUSED = [
    dict(optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.1),
    dict(optimizer=EmbOptimType.EXACT_ADAGRAD, learning_rate=0.1, eps=1e-3),
    dict(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-3),
]
ADAM = dict(optimizer=EmbOptimType.ADAM, learning_rate=0.05, eps=1e-8, beta1=0.8, beta2=0.95)


def _configs(names=TABLES):
    return [torchrec.EmbeddingBagConfig(name=n, embedding_dim=DIMS.get(n, 8), num_embeddings=KEYS,
                                        feature_names=[n.replace("table", "feature")]) for n in names]


def _step_input(step, pg, weighted=False):
    batch = models.random_batch(FEATURES, BATCH, KEYS, seed=100 + step)
    return batch, models.kjt(batch, models.local_samples(BATCH, pg), weighted)


def _backward(out, pg):
    # Both sides divide gradients by the world size the same way (TorchRec's
    # gradient division); the factor keeps the update that of the global
    # sum-loss, which the single-process SparseAdam reference computes.
    (models.loss_of(out) * pg.size()).backward()


def _close(actual, expected, what):
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{what}: {m}")


def _check_rows(model, configs, weights, pg, what, native=None, kind="ebc"):
    """The dynamic tables' rows (every key 0..N-1) equal `weights`; with
    `native`, the native tables' too. Nothing was evicted or lost."""
    stats = dynamicemb.table_stats(model, pg)
    for c in configs:
        if native is not None and c.name in native:
            rows = models.native_rows(model, models.weight_fqn(kind, c.name), pg)
        else:
            rows, owner = models.stored_rows(model, c.name, torch.arange(c.num_embeddings), pg)
            assert bool((owner >= 0).all()), f"{what} {c.name}: keys lost"
            s = stats[c.name]
            assert (s["size"], s["evicted"], s["failed"]) == (c.num_embeddings, 0, 0), f"{what} {c.name}: {s}"
        _close(rows[:, :c.embedding_dim], weights[c.name], f"{what} {c.name} rows")


def _vs_fused(world_pg):
    configs = _configs()
    start = models.initial_weights(configs)
    # Weighted features (per-sample weights) once, with SGD.
    for kind, fused in [("ebc", f) for f in FUSED] + [("weighted_ebc", FUSED[0])]:
        what = f"{kind} {fused['optimizer'].name}"
        native, dynamic = models.native_and_dynamic(kind, configs, world_pg, fused, start)
        for step in range(STEPS):
            _, kjt = _step_input(step, world_pg, weighted=kind == "weighted_ebc")
            ref, out = models.resolved(native(kjt)), models.resolved(dynamic(kjt))
            _close(out.values(), ref.values(), f"{what} step {step} output")
            _backward(ref, world_pg)
            _backward(out, world_pg)
        trained = {c.name: models.native_rows(native, models.weight_fqn(kind, c.name), world_pg)
                   for c in configs}
        assert not torch.allclose(trained["a_table"], start["a_table"].to(torch.float64)), "native did not train"
        _check_rows(dynamic, configs, trained, world_pg, what)


def _embedding_bags(configs, start, mode):
    """torch's nn.EmbeddingBag per table (sparse gradients), holding `start`'s rows."""
    bags = {c.name: nn.EmbeddingBag(KEYS, c.embedding_dim, mode=mode, sparse=True) for c in configs}
    for c in configs:
        with torch.no_grad():
            bags[c.name].weight.copy_(start[c.name])
    return bags


def _train_beside(configs, bags, opt, dynamic, pg, label) -> bool:
    """STEPS steps of the dynamic model on this rank's samples and of the
    reference bags (optimizer `opt`) on the global batch: outputs every step,
    rows at the end. Returns whether some batch had an empty bag."""
    saw_empty = False
    for step in range(STEPS):
        batch, kjt = _step_input(step, pg)
        saw_empty |= any(not bag for f in FEATURES for bag in batch[f])
        full = models.kjt(batch).to_dict()  # the reference sees the global batch
        ref = torch.cat([bags[c.name](full[f].values(), full[f].offsets()) for c, f in zip(configs, FEATURES)], 1)
        out = models.resolved(dynamic(kjt))
        _close(out.values(), ref[models.local_samples(BATCH, pg)], f"{label} step {step} output")
        opt.zero_grad()
        ((ref.to(torch.float64) - 0.5) ** 2).sum().backward()
        opt.step()
        _backward(out, pg)
    _check_rows(dynamic, configs, {n: b.weight.detach() for n, b in bags.items()}, pg, label)
    return saw_empty


def _vs_sparse_adam(pg, hbm_rows=None):
    """hbm_rows: hybrid tables, whose rows past the first hbm_rows of a_table
    on each rank (twice as many of b_table's narrower rows) live in a second
    part (table_rows.py; on the CPU, a second tensor)."""
    configs = _configs()
    start = models.initial_weights(configs, seed=1)
    bags = _embedding_bags(configs, start, "sum")
    adam = torch.optim.SparseAdam([b.weight for b in bags.values()], lr=ADAM["learning_rate"],
                                  betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"])
    share = {} if hbm_rows is None else dict(
        global_hbm_for_values=pg.size() * dynamicemb.get_table_value_bytes(hbm_rows, DIMS["a_table"], optimizer=ADAM["optimizer"]))
    dynamic = models.build("ebc", configs, pg, models.dynamic_constraints(TABLES, **share), ADAM)
    for c in configs:
        models.set_dynamic_rows(dynamic, c.name, start[c.name], pg)
    label = f"adam {pg.size()} ranks" + ("" if hbm_rows is None else f", hybrid at {hbm_rows} rows")
    _train_beside(configs, bags, adam, dynamic, pg, label)
    if hbm_rows is not None:
        stats = dynamicemb.table_stats(dynamic, pg)
        for name, rows in (("a_table", hbm_rows), ("b_table", 2 * hbm_rows)):
            s = stats[name]
            assert s["device_capacity"] == pg.size() * rows and s["device_rows"] + s["host_rows"] == KEYS, s
            assert s["device_rows"] > 0 and s["host_rows"] > 0, s  # both parts hold trained rows


def _mean_vs_embedding_bag(pg):
    """MEAN pooling on the ranks of `pg` against torch's nn.EmbeddingBag
    (mode="mean", SGD on its sparse gradient) over the same rows and the
    global batch: outputs of every step (empty bags read zeros) and the
    trained rows."""
    configs = [torchrec.EmbeddingBagConfig(name=n, embedding_dim=DIMS[n], num_embeddings=KEYS,
                                           feature_names=[n.replace("table", "feature")],
                                           pooling=torchrec.PoolingType.MEAN) for n in TABLES]
    start = models.initial_weights(configs, seed=3)
    bags = _embedding_bags(configs, start, "mean")
    sgd = torch.optim.SGD([b.weight for b in bags.values()], lr=FUSED[0]["learning_rate"])
    dynamic = models.build("ebc", configs, pg, models.dynamic_constraints(TABLES), FUSED[0])
    for c in configs:
        models.set_dynamic_rows(dynamic, c.name, start[c.name], pg)
    assert _train_beside(configs, bags, sgd, dynamic, pg, f"mean {pg.size()} ranks"), "the batches had no empty bag"


def _mixed(world_pg, kind):
    """native_table (FUSED) beside two dynamic tables, against the pure-native
    model of the same three tables. The native table gets a sharding type that
    TorchRec's own sharder offers on CPU: TABLE_WISE in the EBC (a sharding of
    its own), ROW_WISE in the EC (the same RW sharding as the dynamic tables,
    routed by TorchRec's block rule)."""
    names = ["native_table"] + TABLES
    configs = _configs(names) if kind == "ebc" else models.ec_configs(names, dim=8, num_embeddings=KEYS)
    start = models.initial_weights(configs, seed=2)
    for fused in FUSED[:2]:
        what = f"mixed {kind} {fused['optimizer'].name}"
        constraints = models.dynamic_constraints(TABLES)
        native_type = "table_wise" if kind == "ebc" else "row_wise"
        constraints["native_table"] = ParameterConstraints(sharding_types=[native_type], compute_kernels=["fused"])
        mixed = models.build(kind, configs, world_pg, constraints, fused, collective=True)
        native = models.native_model(configs, world_pg, fused, kind)
        plan = mixed.plan.plan[""]
        assert (plan["native_table"].sharding_type, plan["native_table"].compute_kernel) == (native_type, "fused")
        assert all(plan[t].compute_kernel == "customized_kernel" for t in TABLES)
        for c in configs:
            models.set_native_rows(native, models.weight_fqn(kind, c.name), start[c.name])
        models.set_native_rows(mixed, models.weight_fqn(kind, "native_table"), start["native_table"])
        for t in TABLES:
            models.set_dynamic_rows(mixed, t, start[t], world_pg)
        for step in range(STEPS):
            batch = models.random_batch([c.feature_names[0] for c in configs], BATCH, KEYS, seed=200 + step)
            kjt = models.kjt(batch, models.local_samples(BATCH, world_pg))
            ref, out = models.resolved(native(kjt)), models.resolved(mixed(kjt))
            for f in batch:
                r, o = (ref[f], out[f]) if kind == "ebc" else (ref[f].values(), out[f].values())
                _close(o, r, f"{what} step {step} {f}")
            _backward(ref, world_pg)
            _backward(out, world_pg)
        trained = {c.name: models.native_rows(native, models.weight_fqn(kind, c.name), world_pg)
                   for c in configs}
        _check_rows(mixed, configs, trained, world_pg, what, native={"native_table"}, kind=kind)


def _shared_table(world_pg, kind):
    """A table feeding two features (a_table: a_feature and c_feature, as a
    user table serves a clicked and a viewed id list) beside a table of one,
    against the pure-native model: each feature's output every step, and the
    rows, which both features' gradients update."""
    features = {"a_table": ["a_feature", "c_feature"], "b_table": ["b_feature"]}
    if kind == "ec":
        configs = [torchrec.EmbeddingConfig(name=n, embedding_dim=8, num_embeddings=KEYS, feature_names=f)
                   for n, f in features.items()]
    else:
        configs = [torchrec.EmbeddingBagConfig(name=n, embedding_dim=DIMS[n], num_embeddings=KEYS, feature_names=f)
                   for n, f in features.items()]
    what = f"shared table {kind}"
    native, dynamic = models.native_and_dynamic(kind, configs, world_pg, FUSED[0], models.initial_weights(configs, 4))
    for step in range(STEPS):
        batch = models.random_batch(["a_feature", "b_feature", "c_feature"], BATCH, KEYS, seed=300 + step)
        # (An EC given a KJT with weights leaves them out, as TorchRec's own sequence kernels do.)
        kjt = models.kjt(batch, models.local_samples(BATCH, world_pg), weighted=kind in ("weighted_ebc", "ec"))
        ref, out = models.resolved(native(kjt)), models.resolved(dynamic(kjt))
        for f in batch:
            r, o = (ref[f], out[f]) if kind != "ec" else (ref[f].values(), out[f].values())
            _close(o, r, f"{what} step {step} {f}")
        _backward(ref, world_pg)
        _backward(out, world_pg)
    trained = {c.name: models.native_rows(native, models.weight_fqn(kind, c.name), world_pg) for c in configs}
    _check_rows(dynamic, configs, trained, world_pg, what, kind=kind)


def _parity(rank, world):
    world_pg, own_pg = models.rank_groups()
    _vs_fused(world_pg)
    _vs_sparse_adam(own_pg)
    _vs_sparse_adam(world_pg)
    _vs_sparse_adam(world_pg, hbm_rows=8)
    _mean_vs_embedding_bag(world_pg)
    _mixed(world_pg, "ebc")
    _mixed(world_pg, "ec")
    for kind in ("ebc", "weighted_ebc", "ec"):
        _shared_table(world_pg, kind)
    return True


def test_dynamic_matches_native_and_sparse_adam():
    assert run_ranks(_parity, 2) == [True, True]
