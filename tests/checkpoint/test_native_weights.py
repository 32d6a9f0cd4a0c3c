"""A model moved from native TorchRec tables to dynamic ones keeps what the
native tables learned: the native model's state dict (after dcp.load, as a
user restores it) given to the dynamic model's load_state_dict stores key i
with row i (dynamicemb.checkpoint.native_rows).

Against the native model itself, on 2 ranks: from a ROW_WISE model's
ShardedTensor (a row block per rank), a TABLE_WISE one's (one rank holds
every row), a plain tensor of every row on every rank, and an
EmbeddingCollection's ROW_WISE weights, every key
0..N-1 is stored once, on its owner, with the native row; the eval outputs
are the native model's; and both models trained on with SGD (no optimizer
state to lose) keep equal rows. Refused, naming the table, the model
unchanged: a weight of another dim, one given on one rank only, a
column-wise sharded one, and slots and a weight together."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torchrec

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchrec"))
import ckpt_helpers as H  # noqa: E402
import models as M  # noqa: E402

TABLES = {"a_table": 8, "b_table": 4}
EC_DIMS = {"a_table": 8, "b_table": 8}  # an EmbeddingCollection's tables share one dim
KEYS, BATCH = 48, 8
CASES = ("row_wise", "table_wise", "whole", "ec_row_wise")
FEATURES = [t.replace("table", "feature") for t in TABLES]


def _configs(kind="ebc"):
    config = torchrec.EmbeddingConfig if kind == "ec" else torchrec.EmbeddingBagConfig
    return [config(name=n, embedding_dim=d, num_embeddings=KEYS, feature_names=[n.replace("table", "feature")])
            for n, d in _dims(kind).items()]


def _dims(kind):
    return EC_DIMS if kind == "ec" else TABLES


def _fqn(kind, table):
    return M.weight_fqn(kind, table)


def _native(pg, sharding: str, kind="ebc"):
    """The native FUSED collection, sharded `sharding` by TorchRec's sharder."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan, row_wise,
                                                    table_wise)
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    if kind == "ec":
        module = torchrec.EmbeddingCollection(tables=_configs(kind), device=torch.device("meta"))
        sharder = EmbeddingCollectionSharder(fused_params=M.SGD)
    else:
        module = torchrec.EmbeddingBagCollection(tables=_configs(kind), device=torch.device("meta"))
        sharder = EmbeddingBagCollectionSharder(fused_params=M.SGD)
    kernel = EmbeddingComputeKernel.FUSED.value
    spec = {"row_wise": lambda: row_wise(compute_kernel=kernel), "table_wise": lambda: table_wise(rank=0,
            compute_kernel=kernel), "column_wise": lambda: column_wise(ranks=[0, 1], compute_kernel=kernel)}[sharding]
    plan = construct_module_sharding_plan(module, {n: spec() for n in TABLES}, sharder=sharder,
                                          local_size=pg.size(), world_size=pg.size(), device_type="cpu")
    return DistributedModelParallel(module, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                    plan=ShardingPlan({"": plan}), sharders=[sharder])


def _dynamic(pg, kind="ebc"):
    return M.build(kind, _configs(kind), pg, M.dynamic_constraints(list(TABLES)), M.SGD)


def _step(model, seed, pg):
    batch = M.random_batch(FEATURES, BATCH, KEYS, seed=seed)
    out = M.resolved(model(M.kjt(batch, M.local_samples(BATCH, pg))))
    (M.loss_of(out) * pg.size()).backward()


def _probe(model):
    model.eval()
    out = M.output_values(M.resolved(model(M.kjt(M.random_batch(FEATURES, BATCH, KEYS, seed=999)))))
    model.train()
    return out


def _rows(model, pg, native, kind="ebc"):
    if native:
        return {n: M.native_rows(model, _fqn(kind, n), pg) for n in TABLES}
    out = {}
    for n, d in _dims(kind).items():
        rows, owner = M.stored_rows(model, n, torch.arange(KEYS), pg)
        out[n] = (rows[:, :d], owner)
    return out


def _refused(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "not refused"


def _runs(rank, world, root):
    import torch.distributed.checkpoint as dcp

    pg = dist.GroupMember.WORLD
    res = {}
    for case in CASES:
        kind = "ec" if case.startswith("ec") else "ebc"
        sharding = "table_wise" if case == "table_wise" else "row_wise"
        old = _native(pg, sharding, kind)
        for s in (1, 2):
            _step(old, s, pg)
        path = os.path.join(root, case)
        dcp.save(old.state_dict(), checkpoint_id=path, process_group=pg)
        restored = _native(pg, sharding, kind)
        sd = restored.state_dict()
        dcp.load(sd, checkpoint_id=path, process_group=pg)
        if case == "whole":  # every row on every rank, as a plain tensor
            sd = {_fqn(kind, n): M.native_rows(restored, _fqn(kind, n), pg).float() for n in TABLES}
        new = _dynamic(pg, kind)
        _step(new, 7, pg)  # something to replace
        r = dict(incompatible=repr(new.load_state_dict(sd)), want=_rows(old, pg, True, kind),
                 got=_rows(new, pg, False, kind), probe=(_probe(old), _probe(new)))
        for s in (3, 4):
            _step(old, s, pg)
            _step(new, s, pg)
        r["trained"] = (_rows(old, pg, True, kind), _rows(new, pg, False, kind))
        res[case] = r
    # Refusals: the dynamic model is left as it was.
    new = _dynamic(pg)
    _step(new, 7, pg)
    before = _rows(new, pg, False)
    old = _native(pg, "row_wise")
    sd = old.state_dict()
    narrow = {**sd, "embedding_bags.b_table.weight": torch.zeros(KEYS, 3)}
    res["dim"] = _refused(new.load_state_dict, narrow)
    one_rank = {k: v for k, v in sd.items() if rank == 0 or "a_table" not in k}
    res["one_rank"] = _refused(new.load_state_dict, one_rank)
    both = dict(sd)
    both.update({k: v for k, v in new.state_dict().items() if "a_table.dynamicemb" in k})
    res["both"] = _refused(new.load_state_dict, both)
    res["columns"] = _refused(new.load_state_dict, _native(pg, "column_wise").state_dict())
    after = _rows(new, pg, False)
    res["unchanged"] = all(torch.equal(before[n][0], after[n][0]) for n in TABLES)
    return res


@pytest.fixture(scope="module")
def ranks():
    return H.run_in_scratch("dynamicemb-native-weights-", _runs, 2)


@pytest.mark.parametrize("case", CASES)
def test_native_weights_load_into_dynamic_tables(ranks, case):
    for rank in ranks:
        r = rank[case]
        assert r["incompatible"] == "<All keys matched successfully>"
        for n in TABLES:
            rows, owner = r["got"][n]
            assert bool((owner >= 0).all()), f"{n}: keys not stored"
            assert torch.equal(rows, r["want"][n]), f"{n}: rows differ from the native table's"
            old, (new, _) = r["trained"][0][n], r["trained"][1][n]
            torch.testing.assert_close(new, old, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["probe"][1], r["probe"][0], rtol=1e-6, atol=1e-6)  # (sums in another order)


@pytest.mark.parametrize("case,words", [
    ("dim", ["'b_table'", "rows of 3 values", "dim is 4"]),
    ("one_rank", ["'a_table'", "reached 1 of 2 ranks"]),
    ("both", ["'a_table'", "both its dynamic slots and a native weight"]),
    ("columns", ["split by columns"]),
])
def test_unusable_native_weights_are_refused_by_table(ranks, case, words):
    for r in ranks:
        msg = r[case]
        assert msg.startswith("CheckpointError"), msg
        assert all(w in msg for w in words), msg
        assert r["unchanged"]
