"""model.fused_optimizer drives dynamic tables as it drives TorchRec's FUSED
tables. Started from the same rows and fed the same batches, a model of
dynamic tables under an LR schedule (torch's LambdaLR; TorchRec's
WarmupOptimizer over a model mixing a FUSED table with dynamic ones) trains
exactly like the native model under the same schedule, on 2 ranks, for
EmbeddingBagCollection and EmbeddingCollection; set_optimizer_step and
update_hyper_parameters reach the tables, the latter as FBGEMM's does (until the
next step() sets the group's rate again). The optimizer adds nothing to a
checkpoint but its groups' rates (save_param_groups), which load back group
by group: the rows and their state are in model.state_dict()."""
import torch
import torchrec
from torchrec.distributed.planner import ParameterConstraints
from torchrec.optim.keyed import CombinedOptimizer
from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

import models
from dynamicemb.optimizer import EmbOptimType
from dynamicemb.stats import dynamic_modules
from multiprocess import run_ranks
from test_native_parity import BATCH, KEYS, STEPS, TABLES, _backward, _check_rows, _configs

ROWWISE = dict(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-3)


def _train(model, optimizer, schedule, pg, names, seed):
    """STEPS steps of a plain loop (zero_grad, forward, backward, step, the
    schedule's step); returns each step's output, per feature."""
    outs = []
    for step in range(STEPS):
        batch = models.random_batch([n.replace("table", "feature") for n in names], BATCH, KEYS, seed=seed + step)
        optimizer.zero_grad()
        out = models.resolved(model(models.kjt(batch, models.local_samples(BATCH, pg))))
        per_feature = out.to_dict() if isinstance(out, torchrec.KeyedTensor) else {f: out[f].values() for f in out}
        outs.append({f: v.detach() for f, v in per_feature.items()})
        _backward(out, pg)
        optimizer.step()
        if schedule is not None:
            schedule.step()
    return outs


def _close_outputs(out, ref, what):
    assert sorted(out) == sorted(ref), what
    for f in ref:
        torch.testing.assert_close(out[f], ref[f], rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} {f}: {m}")


def _lambda_lr(pg, kind, fused):
    """torch's LambdaLR over model.fused_optimizer, halving the rate every step."""
    configs = _configs() if kind == "ebc" else models.ec_configs(TABLES, dim=8, num_embeddings=KEYS)
    start = models.initial_weights(configs, seed=4)
    what = f"LambdaLR {kind} {fused['optimizer'].name}"
    native, dynamic = models.native_and_dynamic(kind, configs, pg, fused, start)
    runs = []
    for model in (native, dynamic):
        opt = model.fused_optimizer
        runs.append(_train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s), pg, TABLES, 300))
    opt.zero_grad()  # the schedule's last rate reaches the tables, as it would the next step's
    for step, (ref, out) in enumerate(zip(*runs)):
        _close_outputs(out, ref, f"{what} step {step}")
    trained = {c.name: models.native_rows(native, models.weight_fqn(kind, c.name), pg) for c in configs}
    _check_rows(dynamic, configs, trained, pg, what, kind=kind)
    lrs = {m.learning_rate for m in dynamic_modules(dynamic)}
    assert lrs == {fused["learning_rate"] * 0.5 ** STEPS}, f"{what}: tables' rates {lrs}"


def _warmup_mixed(pg):
    """TorchRec's WarmupOptimizer (linear warm-up, then step decay) over one
    CombinedOptimizer of a model holding a FUSED table beside two dynamic
    ones, against the pure-native model under the same optimizer."""
    names = ["native_table"] + TABLES
    configs = _configs(names)
    start = models.initial_weights(configs, seed=5)
    constraints = models.dynamic_constraints(TABLES)
    constraints["native_table"] = ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
    mixed = models.build("ebc", configs, pg, constraints, models.SGD, collective=True)
    native = models.native_model(configs, pg, models.SGD)
    for c in configs:
        models.set_native_rows(native, models.weight_fqn("ebc", c.name), start[c.name])
    models.set_native_rows(mixed, models.weight_fqn("ebc", "native_table"), start["native_table"])
    for t in TABLES:
        models.set_dynamic_rows(mixed, t, start[t], pg)
    stages = [WarmupStage(policy=WarmupPolicy.LINEAR, max_iters=2, value=0.25),
              WarmupStage(policy=WarmupPolicy.STEP, max_iters=STEPS, value=0.5, decay_iters=1)]
    runs = []
    for model in (native, mixed):
        opt = WarmupOptimizer(CombinedOptimizer([model.fused_optimizer]), stages, lr=models.SGD["learning_rate"])
        runs.append(_train(model, opt, None, pg, names, 400))
    for step, (ref, out) in enumerate(zip(*runs)):
        _close_outputs(out, ref, f"warm-up step {step}")
    trained = {c.name: models.native_rows(native, models.weight_fqn("ebc", c.name), pg) for c in configs}
    _check_rows(mixed, configs, trained, pg, "warm-up mixed", native={"native_table"})


def _hyper_parameters(pg):
    """set_optimizer_step and update_hyper_parameters of model.fused_optimizer
    reach every dynamic table; a name FBGEMM's TBE takes but the tables do
    not is refused, naming them, with nothing changed."""
    adam = dict(optimizer=EmbOptimType.ADAM, learning_rate=0.05)
    model = models.build("ebc", _configs(), pg, models.dynamic_constraints(TABLES), adam)
    opt = model.fused_optimizer
    opt.set_optimizer_step(7)
    opt.update_hyper_parameters({"lr": 0.02, "eps": 1e-4, "beta1": 0.5, "beta2": 0.75, "weight_decay": 0.01})
    (m,) = dynamic_modules(model)
    assert (m.optimizer_step, m.learning_rate, m.eps, m.beta1, m.beta2, m.weight_decay) == \
        (7, 0.02, 1e-4, 0.5, 0.75, 0.01)
    opt.step()  # the group's rate again, as FBGEMM's fused optimizer sets a FUSED table's
    assert (m.learning_rate, m.eps) == (0.05, 1e-4)
    try:
        opt.update_hyper_parameters({"eps": 1e-3, "lower_bound": 0.1})
    except ValueError as e:
        assert "lower_bound" in str(e) and "a_table" in str(e), e
    else:
        raise AssertionError("lower_bound was taken")
    assert m.eps == 1e-4
    # Nothing of the optimizer goes into a checkpoint beside the model's state_dict.
    assert opt.state_dict() == {"state": {}}


def _rates(model):
    """The learning rate every table group of the model would use next."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
    lookups = [lk for sub in model.modules() for lk in sub.__dict__.get("_lookups", [])]  # a plain list
    tbes = [m for lk in lookups for m in lk.modules() if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen)]
    return [t.get_learning_rate() for t in tbes] + [m.get_learning_rate() for m in dynamic_modules(model)]


def _update_then_step(pg):
    """update_hyper_parameters then step(): the tables' rates go as a FUSED
    table's do (the update, then the group's rate again)."""
    configs = _configs()
    native, dynamic = models.native_and_dynamic("ebc", configs, pg, models.SGD, models.initial_weights(configs))
    seen = []
    for model in (native, dynamic):
        opt, rates = model.fused_optimizer, []
        opt.update_hyper_parameters({"lr": 0.02})
        rates.append(_rates(model))
        opt.step()
        rates.append(_rates(model))
        seen.append([{round(x, 7) for x in r} for r in rates])  # FBGEMM keeps its rate in float32
    assert seen[0] == seen[1] == [{0.02}, {models.SGD["learning_rate"]}], seen


def _saved_rates(pg):
    """Two dynamic groups (a SUM and a MEAN table) whose rates a schedule
    made differ: a saved optimizer (save_param_groups) loads each group's
    rate back into a fresh model. KeyedOptimizer matches groups by their
    parameters' names; the dynamic groups had none, so all got one rate."""
    configs = [torchrec.EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=KEYS, feature_names=[f],
                                           pooling=p)
               for n, f, p in (("s_table", "s_feature", torchrec.PoolingType.SUM),
                               ("m_table", "m_feature", torchrec.PoolingType.MEAN))]
    saved = None
    for rates in ((0.3, 0.07), None):
        model = models.build("ebc", configs, pg, models.dynamic_constraints([c.name for c in configs]), models.SGD)
        opt = CombinedOptimizer([model.fused_optimizer])
        opt.save_param_groups(True)
        assert len(opt.param_groups) == 2 and len(list(dynamic_modules(model))) == 2
        if rates is not None:
            for group, lr in zip(opt.param_groups, rates):
                group["lr"] = lr
            saved = opt.state_dict()
        else:
            opt.load_state_dict(saved)
    opt.step()  # the groups' rates reach the tables
    assert sorted(m.get_learning_rate() for m in dynamic_modules(model)) == [0.07, 0.3]
    assert [g["lr"] for g in opt.param_groups] == [0.3, 0.07]


def _ranks(rank, world):
    pg = models.rank_groups()[0]
    for kind, fused in (("ebc", models.SGD), ("ebc", ROWWISE), ("ec", models.SGD)):
        _lambda_lr(pg, kind, fused)
    _warmup_mixed(pg)
    _hyper_parameters(pg)
    _update_then_step(pg)
    _saved_rates(pg)
    return True


def test_fused_optimizer_schedules_dynamic_tables_as_native_ones():
    assert run_ranks(_ranks, 2) == [True, True]
