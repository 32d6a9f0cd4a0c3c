"""Eval mode looks keys up without inserting them (missing keys read zeros)
and leaves every stored key's score unchanged; train mode inserts again;
dynamicemb.table_stats is rank-local, and with a process group sums over the
ranks. A dynamic table given a non-ROW_WISE plan by hand is refused when
sharding."""
import pytest
import torch
import torch.distributed as dist

import dynamicemb
import models
from multiprocess import run_ranks

TABLES = ["a_table", "b_table"]
FEATURES = [t.replace("table", "feature") for t in TABLES]
DIM = 4
TRAIN_KEYS = list(range(0, 30))
NEW_KEYS = list(range(1000, 1012))


def _batch(rank, keys_per_bag):
    """Per feature, one bag per entry of keys_per_bag: both ranks feed the
    first feature the same keys (stored once), the second different ones."""
    return {f: [[k + rank * 100 * (f == FEATURES[1]) for k in bag] for bag in keys_per_bag] for f in FEATURES}


def _all_keys(world, keys_per_bag):
    return {f: sorted({k for r in range(world) for bag in _batch(r, keys_per_bag)[f] for k in bag}) for f in FEATURES}


def _sizes(model, pg=None):
    return {t: s["size"] for t, s in dynamicemb.table_stats(model, pg).items()}


def _check_stats_sum(model, pg):
    local = dynamicemb.table_stats(model)
    summed = dynamicemb.table_stats(model, pg)
    every = [None] * pg.size()
    dist.all_gather_object(every, local, group=pg)
    assert set(summed) == set(TABLES)
    for t in TABLES:
        for k, v in summed[t].items():
            assert v == sum(s[t][k] for s in every), (t, k, v, [s[t][k] for s in every])
    return summed


def _eval_stats(rank, world):
    pg = models.rank_groups()[0]
    results = {}
    for kind in ("ebc", "ec"):
        configs = (models.ebc_configs if kind == "ebc" else models.ec_configs)(TABLES, dim=DIM, num_embeddings=256)
        model = models.build(kind, configs, pg, models.dynamic_constraints(TABLES), models.SGD)
        train_bags = [TRAIN_KEYS[i::3] for i in range(3)]
        models.loss_of(models.resolved(model(models.kjt(_batch(rank, train_bags))))).backward()
        stored = _all_keys(world, train_bags)
        summed = _check_stats_sum(model, pg)
        for t, f in zip(TABLES, FEATURES):
            assert summed[t]["size"] == summed[t]["inserted"] == len(stored[f]), (t, summed[t])
        before = {t: models.stored_rows(model, t, torch.tensor(stored[f]), pg)[0] for t, f in zip(TABLES, FEATURES)}
        scores = {t: models.local_scores(model, t) for t in TABLES}
        assert all(scores[t] for t in TABLES), "this rank stores no keys: the score check would be empty"

        # Eval: new keys read zeros and are not stored; known keys read their rows.
        model.eval()
        eval_bags = [NEW_KEYS[:4], [TRAIN_KEYS[0], NEW_KEYS[5]], []]
        out = models.resolved(model(models.kjt(_batch(rank, eval_bags))))
        assert _sizes(model, pg) == {t: summed[t]["size"] for t in TABLES}, "eval inserted keys"
        assert dynamicemb.table_stats(model, pg) == summed, "eval changed the counters"
        for t in TABLES:
            assert models.local_scores(model, t) == scores[t], f"{t}: eval changed scores"
        for t, f in zip(TABLES, FEATURES):
            rows, _ = models.stored_rows(model, t, torch.tensor(stored[f]), pg)
            assert torch.equal(rows, before[t]), f"{t}: eval changed rows"
            known = _batch(rank, eval_bags)[f][1][0]
            known_row = rows[stored[f].index(known), :DIM].to(torch.float32)
            if kind == "ebc":
                pooled = out[f]
                assert torch.equal(pooled[0], torch.zeros(DIM)), f"{t}: missing keys did not read zeros"
                torch.testing.assert_close(pooled[1], known_row, rtol=0, atol=1e-6)
                assert torch.equal(pooled[2], torch.zeros(DIM))
            else:
                ids = out[f].values()  # one row per id: 4 missing, the known key, a missing one
                assert torch.equal(ids[[0, 1, 2, 3, 5]], torch.zeros(5, DIM)), f"{t}: missing keys did not read zeros"
                torch.testing.assert_close(ids[4], known_row, rtol=0, atol=1e-6)

        # Train again: the same batch inserts the new keys.
        model.train()
        models.loss_of(models.resolved(model(models.kjt(_batch(rank, eval_bags))))).backward()
        grown = _all_keys(world, train_bags + eval_bags)
        assert _sizes(model, pg) == {t: len(grown[f]) for t, f in zip(TABLES, FEATURES)}, "train did not insert"
        _check_stats_sum(model, pg)
        results[kind] = _sizes(model)  # this rank's share
        if kind == "ebc":  # training refreshes the scores of the keys it touches (TIMESTAMP)
            after = models.local_scores(model, TABLES[0])
            touched = [k for k in scores[TABLES[0]] if k in set(_batch(rank, eval_bags)[FEATURES[0]][1])]
            assert all(after[k] > scores[TABLES[0]][k] for k in touched), "train did not refresh scores"
    _refuse_table_wise_dynamic(pg)
    return results


def _refuse_table_wise_dynamic(pg):
    """A plan written by hand that gives a dynamic table TABLE_WISE is
    refused by our sharded collection, naming the table."""
    import pytest
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import table_wise
    from torchrec.distributed.types import ShardingEnv
    from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder
    from dynamicemb.shard.parameter_sharding import DynamicEmbParameterSharding

    configs = models.ebc_configs(TABLES, dim=DIM, num_embeddings=256)
    module = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    sharder = DynamicEmbeddingBagCollectionSharder(fused_params=models.SGD)
    planner = models.DynamicEmbeddingShardingPlanner(
        configs, topology=models.Topology(world_size=pg.size(), compute_device="cpu"),
        constraints=models.dynamic_constraints(TABLES))
    plan = planner.plan(module, [sharder])
    ps = plan.plan[""][TABLES[0]]
    tw = table_wise(rank=0, compute_kernel="customized_kernel")(
        module.embedding_bags[TABLES[0]].weight, pg.size(), pg.size(), "cpu", sharder)
    plan.plan[""][TABLES[0]] = DynamicEmbParameterSharding(
        sharding_type=tw.sharding_type, compute_kernel=tw.compute_kernel, ranks=tw.ranks,
        sharding_spec=tw.sharding_spec, dynamicemb_options=ps.dynamicemb_options)
    with pytest.raises(ValueError, match=f"{TABLES[0]}.*table_wise.*ROW_WISE only"):
        DistributedModelParallel(module, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                 plan=plan, sharders=[sharder])


def test_eval_inserts_nothing_and_stats_sum_over_ranks():
    per_rank = run_ranks(_eval_stats, 2)
    for kind in ("ebc", "ec"):
        # Both ranks hold part of each table (routing spreads the keys).
        assert all(per_rank[r][kind][t] > 0 for r in range(2) for t in TABLES), per_rank


def test_stats_collective_device_follows_the_backend(monkeypatch):
    """table_stats(model, pg) reduces on the device the group's backend takes:
    CPU for gloo (and groups with a CPU backend), the current CUDA device for
    NCCL alone (which rejects CPU tensors)."""
    from dynamicemb import stats
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, device in [("gloo", "cpu"), ("nccl", "cuda:3"), ("cpu:gloo,cuda:nccl", "cpu")]:
        monkeypatch.setattr(dist, "get_backend", lambda pg=None, b=backend: b)
        assert stats.collective_device(object()) == torch.device(device), backend


def test_stats_refuse_two_tables_of_one_name():
    # A hand-made plan can give two modules a table of the same name (our
    # planner refuses it): their counters would merge under one name.
    two = torch.nn.ModuleList([dynamicemb.BatchedDynamicEmbeddingTables(
        [dynamicemb.DynamicEmbTableOptions(dim=DIM, max_capacity=64)], table_names=["id_table"]) for _ in range(2)])
    with pytest.raises(ValueError, match="two dynamic tables are named 'id_table'"):
        dynamicemb.table_stats(two)
