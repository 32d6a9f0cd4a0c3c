"""Through DMP with our planner, on 1 and 2 gloo ranks: a NO_EVICTION table
fed far more keys than num_embeddings (hence max_capacity per rank) grows
into the memory budget the planner allots it and keeps every key, each row
equal to a dict reference (DEBUG initial value less lr times the key's
occurrences: SGD, loss = sum of the outputs); a table given a small
memory_budget counts its failed keys (summed over ranks), warns naming its
budget, and keeps the rows it stored. The planner's budgets: each
NO_EVICTION table's share of the growth room, by an independent sum; a
memory_budget no rank has is refused by name."""
import warnings
from collections import Counter

import torch

import models
from dynamicemb import DynamicEmbScoreStrategy, table_stats
from dynamicemb.memory import table_bytes
from multiprocess import run_ranks

TABLES = ["grow_table", "small_table"]
FEATURES = [t.replace("table", "feature") for t in TABLES]
NUM_EMBEDDINGS, KEYS, DIM, LR, STEPS, BATCH = 32, 600, 4, 0.5, 4, 8
SMALL_BUDGET = table_bytes(64, DIM * 4)  # EXACT_SGD: no optimizer state


def _batches():
    """Per step {feature: bags}: every key of [0, KEYS) once over the steps, plus repeats."""
    g = torch.Generator().manual_seed(5)
    perm = torch.randperm(KEYS, generator=g).chunk(STEPS)
    for step in range(STEPS):
        ids = torch.cat([perm[step], torch.randint(0, KEYS, (perm[step].numel() // 2,), generator=g)]).tolist()
        bags = [ids[i::BATCH] for i in range(BATCH)]
        yield {f: bags for f in FEATURES}


def _run(rank, world):
    """The model on 1 rank (this rank's own group) and on both."""
    world_pg, own = models.rank_groups()
    return [_train(own), _train(world_pg)]


def _train(pg):
    world = pg.size()
    configs = models.ec_configs(TABLES, dim=DIM, num_embeddings=NUM_EMBEDDINGS)
    constraints = models.dynamic_constraints(TABLES, score_strategy=DynamicEmbScoreStrategy.NO_EVICTION,
                                             bucket_capacity=16)
    constraints["small_table"].dynamicemb_options.memory_budget = SMALL_BUDGET
    model = models.build("ec", configs, pg, constraints, dict(models.SGD, learning_rate=LR))
    counts = Counter()
    warned = []
    for batch in _batches():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = models.resolved(model(models.kjt(batch, models.local_samples(BATCH, pg))))
        warned += [str(w.message) for w in caught if "could not be stored" in str(w.message)]
        # The gradient reaching a row is divided by the world size: scale the loss back.
        (models.output_values(out).sum() * world).backward()
        counts.update(k for b in batch[FEATURES[0]] for k in b)
    stats = table_stats(model, pg=pg)
    keys = torch.arange(KEYS)
    grow_rows, grow_owner = models.stored_rows(model, "grow_table", keys, pg)
    small_rows, small_owner = models.stored_rows(model, "small_table", keys, pg)
    # Plain lists: tensors would go through shared memory, gone when the rank exits.
    return dict(stats=stats, counts=counts, warned=warned, grow=(grow_rows.tolist(), grow_owner.tolist()),
                small=(small_rows.tolist(), small_owner.tolist()))


def _reference(counts, keys):
    init = torch.tensor([[(k % 100000) * 0.01 + j * 0.0001 for j in range(DIM)] for k in keys], dtype=torch.float64)
    return init - LR * torch.tensor([counts[k] for k in keys], dtype=torch.float64)[:, None]


def test_no_eviction_grows_past_max_capacity_through_dmp():
    results = run_ranks(_run, 2)  # [[1-rank run, 2-rank run] of rank 0, ... of rank 1]
    for world in (1, 2):
        _check([res[world - 1] for res in results][:world])


def _check(results):
    r = results[0]
    grow, small = r["stats"]["grow_table"], r["stats"]["small_table"]
    # Every key kept, far past max_capacity (NUM_EMBEDDINGS / world rows per rank).
    assert grow["failed"] == 0 and grow["evicted"] == 0 and grow["size"] == KEYS
    rows, owner = torch.tensor(r["grow"][0], dtype=torch.float64), torch.tensor(r["grow"][1])
    assert bool((owner >= 0).all())
    torch.testing.assert_close(rows[:, :DIM], _reference(r["counts"], range(KEYS)), atol=1e-5, rtol=0)
    # The small budget: failed keys counted, a warning naming the budget, stored rows kept.
    assert small["failed"] > 0 and small["evicted"] == 0 and small["size"] < KEYS
    warned = [w for res in results for w in res["warned"]]
    assert any("'small_table'" in w and f"memory_budget of {SMALL_BUDGET} bytes" in w for w in warned)
    rows, owner = torch.tensor(r["small"][0], dtype=torch.float64), torch.tensor(r["small"][1])
    held = (owner >= 0).nonzero().squeeze(1).tolist()
    assert len(held) == small["size"]
    # A key is stored at its first sighting or never (no eviction; at its budget the table stops growing):
    # every stored key saw all its updates.
    torch.testing.assert_close(rows[held, :DIM], _reference(r["counts"], held), atol=1e-5, rtol=0)


def _planner(constraints, **kwargs):
    from torchrec.distributed.planner import Topology
    from dynamicemb.optimizer import EmbOptimType
    from dynamicemb.planner import DynamicEmbeddingShardingPlanner
    configs = models.ec_configs(["a_table", "b_table", "c_table"], dim=DIM, num_embeddings=4096)
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=1 << 30)
    return DynamicEmbeddingShardingPlanner(configs, topology, constraints=constraints,
                                           optimizer=EmbOptimType.EXACT_SGD, **kwargs), configs


def _plan(planner, configs):
    import torchrec
    from dynamicemb.shard import DynamicEmbeddingCollectionSharder
    module = torchrec.EmbeddingCollection(tables=configs, device=torch.device("meta"))
    planner.plan(module, [DynamicEmbeddingCollectionSharder(fused_params=models.SGD)])
    return {n: o.memory_budget for n, o in planner.options.items()}


def test_planner_allots_no_eviction_tables_the_growth_room():
    S = DynamicEmbScoreStrategy
    constraints = models.dynamic_constraints(["a_table", "b_table"], score_strategy=S.NO_EVICTION)
    constraints.update(models.dynamic_constraints(["c_table"]))
    constraints["b_table"].dynamicemb_options.max_capacity = 4096  # twice a_table's 2048 rows per rank
    planner, configs = _planner(constraints)
    at_max = planner.dynamic_bytes_per_rank()
    budgets = _plan(planner, configs)
    # The reference: half of what the rank has left after every table at max_capacity, shared 1 : 2.
    pool = ((1 << 30) - sum(at_max.values())) // 2
    assert at_max["a_table"] * 2 == at_max["b_table"]
    assert budgets == {"a_table": at_max["a_table"] + pool // 3, "b_table": at_max["b_table"] + pool * 2 // 3,
                       "c_table": at_max["c_table"]}  # c_table evicts: its bytes at max_capacity
    assert all(d.storage.ddr == (1 << 30) - sum(budgets.values()) for d in planner._topology.devices)
    planner, configs = _planner(constraints, no_eviction_growth=0)
    assert _plan(planner, configs) == at_max


def test_planner_refuses_a_memory_budget_no_rank_has():
    constraints = models.dynamic_constraints(["a_table", "b_table", "c_table"],
                                             score_strategy=DynamicEmbScoreStrategy.NO_EVICTION)
    constraints["b_table"].dynamicemb_options.memory_budget = 2 << 30
    planner, configs = _planner(constraints)
    try:
        _plan(planner, configs)
        raise AssertionError("expected a refusal")
    except ValueError as e:
        assert "'b_table'" in str(e) and f"memory_budget of {2 << 30} bytes" in str(e)


def test_a_given_budget_is_the_tables_own_beside_its_admission_counter():
    """An admission counter's bytes are reserved on top of a NO_EVICTION
    table's given memory_budget, not handed to the table as room to grow
    (it grew 4x past its budget into them): the same table without a
    counter is the reference."""
    from dynamicemb import FrequencyAdmissionStrategy, KVCounter
    S = DynamicEmbScoreStrategy
    budget = table_bytes(4096, DIM * 4)
    planned = {}
    for admit in (False, True):
        constraints = models.dynamic_constraints(["a_table", "b_table", "c_table"], score_strategy=S.NO_EVICTION,
                                                 memory_budget=budget)
        if admit:
            o = constraints["a_table"].dynamicemb_options
            o.admit_strategy, o.admission_counter = FrequencyAdmissionStrategy(2), KVCounter(capacity=65536)
        planner, configs = _planner(constraints)
        budgets = _plan(planner, configs)
        planned[admit] = (budgets["a_table"], sum(planner.allotted_bytes_per_rank()["a_table"]))
    assert planned[False][0] == planned[True][0] == budget  # the table's own budget either way
    assert planned[True][1] - planned[False][1] > 65536 * 8  # the counter's room (at least a key per slot) on top
