"""A dynamic table's ParameterConstraints kernel settings (output_dtype,
stochastic_rounding, bounds_check_mode, enforce_hbm, cache_params) reach its
kernel as TorchRec's planner passes a native table's: before, our planner
dropped them, and a table constrained to float16 outputs gave float32 ones."""
import torch
import torchrec
from torchrec.distributed.planner import Topology
from torchrec.modules.embedding_configs import DataType

import models
from dynamicemb.planner import DynamicEmbeddingShardingPlanner
from multiprocess import run_ranks

TABLES = ["a_table", "b_table"]
FEATURES = [t.replace("table", "feature") for t in TABLES]
KEYS, BATCH, STEPS = 48, 8, 3


def _configs(kind):
    return models.configs_of(kind, TABLES, dim=8, num_embeddings=KEYS)


def _fp16_outputs(rank, world):
    """Per kind: (output dtypes of the dynamic and the native model, the
    largest output difference over the steps, the largest row difference
    after them), all plain values."""
    pg = models.rank_groups()[0]
    out = {}
    for kind in ("ebc", "ec"):
        configs = _configs(kind)
        start = models.initial_weights(configs, seed=5)
        constraints = models.dynamic_constraints(TABLES)
        for c in constraints.values():
            c.output_dtype = DataType.FP16
        dynamic = models.build(kind, configs, pg, constraints, models.SGD)
        native = models.native_model(configs, pg, models.SGD, kind, output_dtype=DataType.FP16)
        for c in configs:
            models.set_native_rows(native, models.weight_fqn(kind, c.name), start[c.name])
            models.set_dynamic_rows(dynamic, c.name, start[c.name], pg)
        dtypes, worst = set(), 0.0
        for step in range(STEPS):
            kjt = models.kjt(models.random_batch(FEATURES, BATCH, KEYS, seed=50 + step))
            ref, got = models.resolved(native(kjt)), models.resolved(dynamic(kjt))
            r, g = models.output_values(ref), models.output_values(got)
            dtypes.add((str(g.dtype), str(r.dtype)))
            worst = max(worst, float((g.double() - r.double()).abs().max()))
            models.loss_of(ref).backward()
            models.loss_of(got).backward()
        rows = 0.0
        for c in configs:
            trained = models.native_rows(native, models.weight_fqn(kind, c.name), pg)
            held, owner = models.stored_rows(dynamic, c.name, torch.arange(KEYS), pg)
            assert bool((owner >= 0).all())
            rows = max(rows, float((held[:, :8] - trained).abs().max()))
        out[kind] = (sorted(dtypes), worst, rows)
    return out


def test_output_dtype_constraint_reaches_the_dynamic_kernel_as_a_native_ones():
    got = run_ranks(_fp16_outputs, 1)[0]
    for kind, (dtypes, worst, rows) in got.items():
        assert dtypes == [("torch.float16", "torch.float16")], (kind, dtypes)
        assert worst <= 1e-3, (kind, worst)  # float16 outputs of the same sums
        assert rows <= 1e-3, (kind, rows)


def test_the_plan_carries_the_constraints_kernel_settings():
    configs = _configs("ebc")
    constraints = models.dynamic_constraints(TABLES)
    constraints["a_table"].output_dtype = DataType.BF16
    constraints["a_table"].stochastic_rounding = False
    planner = DynamicEmbeddingShardingPlanner(configs, topology=Topology(world_size=2, compute_device="cpu"),
                                              constraints=constraints)
    sharders = [models.DynamicEmbeddingBagCollectionSharder(fused_params=models.SGD)]
    plan = planner.plan(torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta")), sharders)
    a, b = plan.plan[""]["a_table"], plan.plan[""]["b_table"]
    assert (a.output_dtype, a.stochastic_rounding) == (DataType.BF16, False)
    assert (b.output_dtype, b.stochastic_rounding) == (None, None)
