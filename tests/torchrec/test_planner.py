"""DynamicEmbeddingShardingPlanner (no process group needed: plan() on a
module on meta): huge dynamic tables plan ROW_WISE / CUSTOMIZED_KERNEL with
per-rank capacities, native tables get TorchRec's own plan, storage estimates
include optimizer state, and misuse fails with the table's name."""
import os
import subprocess
import sys

import pytest
import torch
import torchrec
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

import models
from dynamicemb import DynamicEmbTableOptions
from dynamicemb.optimizer import EmbOptimType
from dynamicemb.planner import (
    DynamicEmbeddingShardingPlanner,
    DynamicEmbParameterConstraints,
    get_sharded_table_capacity,
    get_table_value_bytes,
)
from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder
from dynamicemb.tiers import HostStore

HUGE = 2**40
WORLD = 4


def _configs():
    return (models.ebc_configs(["huge_table"], dim=64, num_embeddings=HUGE)
            + models.ebc_configs(["small_table", "other_table"], dim=16, num_embeddings=1000))


def _sharders(fused=models.SGD):
    return [DynamicEmbeddingBagCollectionSharder(fused_params=fused),
            DynamicEmbeddingCollectionSharder(fused_params=fused)]


def _planner(configs, constraints, world=WORLD, ddr_cap=2**60, optimizer=None):
    topology = Topology(world_size=world, compute_device="cpu", ddr_cap=ddr_cap)
    return DynamicEmbeddingShardingPlanner(configs, topology=topology, constraints=constraints, optimizer=optimizer)


def _ebc(configs):
    return torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def test_huge_dynamic_table_plans_row_wise_with_per_rank_capacity():
    configs = _configs()
    plan = _planner(configs, models.dynamic_constraints(["huge_table"])).plan(_ebc(configs), _sharders())
    ps = plan.plan[""]["huge_table"]
    assert (ps.sharding_type, ps.compute_kernel) == ("row_wise", "customized_kernel")
    assert ps.ranks == list(range(WORLD))
    cap = get_sharded_table_capacity(HUGE, WORLD)
    assert cap == HUGE // WORLD  # 2**38 rows: already whole buckets
    assert ps.dynamicemb_options.max_capacity == cap
    assert (ps.dynamicemb_options.dim, ps.dynamicemb_options.embedding_dtype) == (64, torch.float32)
    shards = ps.sharding_spec.shards
    assert [s.shard_offsets for s in shards] == [[r * HUGE // WORLD, 0] for r in range(WORLD)]
    assert all(s.shard_sizes == [HUGE // WORLD, 64] for s in shards)


def _stock_plan(module, natives, world, fused=models.SGD):
    """The reference: TorchRec's own planner and sharders on the native
    tables alone (same fused_params)."""
    sharders = [EmbeddingBagCollectionSharder(fused_params=fused), EmbeddingCollectionSharder(fused_params=fused)]
    topology = Topology(world_size=world, compute_device="cpu", ddr_cap=2**60)
    return EmbeddingShardingPlanner(topology=topology).plan(module(natives), sharders).plan[""]


def _summary(plan):
    return {n: (p.sharding_type, p.compute_kernel, p.ranks) for n, p in plan.items()}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_native_tables_get_stock_torchrecs_plan(kind, world):
    """Native tables beside a dynamic one get exactly the plan of TorchRec's
    planner with TorchRec's sharders: tiny ones data_parallel/dense where
    TorchRec picks it, EBC tables table_wise on CPU (TorchRec's EBC sharder
    offers no row_wise there), never a fused data_parallel table."""
    make, module = ((models.ebc_configs, _ebc) if kind == "ebc"
                    else (models.ec_configs, lambda c: torchrec.EmbeddingCollection(tables=c, device="meta")))
    configs = (make(["dyn_table"], num_embeddings=HUGE) + make(["tiny_table"], num_embeddings=10)
               + make(["small_table"], num_embeddings=1000) + make(["mid_table"], num_embeddings=200_000))
    natives = configs[1:]
    ours = _planner(configs, models.dynamic_constraints(["dyn_table"]), world=world).plan(module(configs), _sharders())
    ours = ours.plan[""]
    assert (ours["dyn_table"].sharding_type, ours["dyn_table"].compute_kernel) == ("row_wise", "customized_kernel")
    del ours["dyn_table"]
    assert _summary(ours) == _summary(_stock_plan(module, natives, world))
    assert all(p.compute_kernel != "fused" for p in ours.values() if p.sharding_type == "data_parallel")


def test_only_native_tables_plan_as_stock_torchrec_does():
    natives = _configs()[1:]
    for fused in (models.SGD, dict(optimizer=EmbOptimType.EXACT_ADAGRAD, learning_rate=0.1, eps=1e-3)):
        ours = _planner(natives, {}).plan(_ebc(natives), _sharders(fused)).plan[""]
        assert _summary(ours) == _summary(_stock_plan(_ebc, natives, WORLD, fused))


def test_our_sharders_offer_what_torchrecs_offer():
    for ours, stock in ((DynamicEmbeddingBagCollectionSharder(), EmbeddingBagCollectionSharder()),
                        (DynamicEmbeddingCollectionSharder(), EmbeddingCollectionSharder())):
        for device in ("cpu", "cuda"):
            assert ours.sharding_types(device) == stock.sharding_types(device)
            for st in stock.sharding_types(device):
                assert ours.compute_kernels(st, device) == stock.compute_kernels(st, device)


@pytest.mark.parametrize("optimizer,width", [
    (EmbOptimType.EXACT_SGD, 16), (EmbOptimType.ADAM, 48),  # Adam: value + two moments
    (EmbOptimType.EXACT_ADAGRAD, 32), (EmbOptimType.EXACT_ROWWISE_ADAGRAD, 17)])
def test_value_bytes_include_optimizer_state(optimizer, width):
    assert get_table_value_bytes(1000, 16, torch.float32, optimizer) == 1000 * width * 4
    assert get_table_value_bytes(1000, 16, torch.float16, optimizer) == 1000 * width * 2
    assert get_table_value_bytes(1000, 16, torch.float32, optimizer, training=False) == 1000 * 16 * 4


ADAM = dict(optimizer=EmbOptimType.ADAM, learning_rate=1e-3)


def _ddr_taken(planner, configs, fused):
    """Bytes of DDR per rank that planning with sharders of `fused` takes
    for the dynamic tables (a CPU topology charges everything to DDR)."""
    planner.plan(_ebc(configs), _sharders(fused))
    return [2**60 - d.storage.ddr for d in planner._topology.devices]


def test_planner_charges_dynamic_tables_with_their_sharders_optimizer():
    """The estimate uses the optimizer of the sharder's fused_params: Adam
    keeps two moments beside each row, 3 x dim values per row in all."""
    dim, n, world = 8, 4096, 2
    configs = models.ebc_configs(["d_table"], dim=dim, num_embeddings=n)
    planner = _planner(configs, models.dynamic_constraints(["d_table"]), world=world)
    rows = -(-(-(-n // world)) // 128) * 128  # ceil(n / world), in buckets of 128
    adam = rows * 3 * dim * 4 + rows * 18     # fp32 value + m + v, and the hash table's 18 bytes per slot
    sgd = rows * dim * 4 + rows * 18
    assert _ddr_taken(planner, configs, ADAM) == [adam] * world
    assert planner.optimizers == {"d_table": EmbOptimType.ADAM}
    assert planner.dynamic_bytes_per_rank() == {"d_table": adam}
    # Planning again (here with SGD) reserves anew, not on top of the last plan.
    assert _ddr_taken(planner, configs, models.SGD) == [sgd] * world
    # An optimizer= that agrees with the sharders is accepted.
    agreeing = _planner(configs, models.dynamic_constraints(["d_table"]), world=world, optimizer=EmbOptimType.ADAM)
    assert agreeing.dynamic_bytes_per_rank() == {"d_table": adam}  # before plan(): the override
    assert _ddr_taken(agreeing, configs, ADAM) == [adam] * world


def test_optimizer_override_contradicting_the_sharder_is_refused():
    configs = models.ebc_configs(["d_table"])
    planner = _planner(configs, models.dynamic_constraints(["d_table"]), optimizer=EmbOptimType.EXACT_SGD)
    with pytest.raises(ValueError, match="d_table.*contradicts.*ADAM"):
        planner.plan(_ebc(configs), _sharders(ADAM))


def test_estimate_before_plan_needs_the_optimizer():
    configs = models.ebc_configs(["d_table"])
    with pytest.raises(RuntimeError, match="d_table.*plan"):
        _planner(configs, models.dynamic_constraints(["d_table"])).dynamic_bytes_per_rank()


def test_unsupported_optimizer_names_the_table():
    configs = models.ebc_configs(["d_table"])
    planner = _planner(configs, models.dynamic_constraints(["d_table"]))
    with pytest.raises(ValueError, match="d_table.*not supported"):
        planner.plan(_ebc(configs), _sharders(dict(optimizer=EmbOptimType.LARS_SGD)))


def test_sharded_capacity_rounds_to_whole_buckets():
    assert get_sharded_table_capacity(1000, 3) == 384  # ceil(1000 / 3) = 334 -> 3 buckets of 128
    assert get_sharded_table_capacity(1000, 3, bucket_capacity=16) == 336
    assert get_sharded_table_capacity(2**62, 8) == 2**59


# ---- misuse ------------------------------------------------------------------------------


def _error(configs, constraints, **kw) -> str:
    with pytest.raises(ValueError) as e:
        _planner(configs, constraints, **kw).plan(_ebc(configs), _sharders())
    return str(e.value)


def test_dynamic_table_must_be_row_wise():
    configs = models.ebc_configs(["d_table"])
    c = DynamicEmbParameterConstraints(use_dynamicemb=True, sharding_types=["table_wise"])
    msg = _error(configs, {"d_table": c})
    assert "d_table" in msg and "ROW_WISE" in msg


def test_dynamic_table_must_run_our_kernel():
    configs = models.ebc_configs(["d_table"])
    c = DynamicEmbParameterConstraints(use_dynamicemb=True, compute_kernels=["fused"])
    msg = _error(configs, {"d_table": c})
    assert "d_table" in msg and "CUSTOMIZED_KERNEL" in msg and "fused" in msg


@pytest.mark.parametrize("as_enums", [False, True], ids=["strings", "enums"])
def test_constraints_that_allow_row_wise_and_our_kernel_among_others_plan_them(as_enums):
    """TorchRec's constraints list what a table may get: a list holding
    ROW_WISE and CUSTOMIZED_KERNEL among others is satisfied by them, given
    as strings or as the enums (ShardingType.ROW_WISE)."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel as K
    from torchrec.distributed.types import ShardingType as S
    configs = models.ebc_configs(["d_table"])
    types, kernels = [S.TABLE_WISE, S.ROW_WISE], [K.FUSED, K.CUSTOMIZED_KERNEL]
    if not as_enums:
        types, kernels = [t.value for t in types], [k.value for k in kernels]
    c = DynamicEmbParameterConstraints(use_dynamicemb=True, sharding_types=types, compute_kernels=kernels)
    planner = DynamicEmbeddingShardingPlanner(configs, topology=Topology(world_size=2, compute_device="cpu"),
                                              constraints={"d_table": c})
    ps = planner.plan(torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta")),
                      [DynamicEmbeddingBagCollectionSharder()]).plan[""]["d_table"]
    assert (ps.sharding_type, ps.compute_kernel) == ("row_wise", "customized_kernel")


def test_torchrecs_planner_refuses_a_dynamic_table_instead_of_folding_its_ids():
    # TorchRec's own planner cannot make a table dynamic: given our
    # constraints it used to plan the table FUSED (a static table of
    # num_embeddings rows, whose bounds check sets larger ids to row 0).
    # The constraints now allow only our kernel, which no stock sharder offers.
    configs = models.ebc_configs(["d_table", "n_table"])
    constraints = models.dynamic_constraints(["d_table"])
    assert constraints["d_table"].compute_kernels == ["customized_kernel"]
    assert DynamicEmbParameterConstraints().compute_kernels is None  # a native table's stay TorchRec's default
    stock = EmbeddingShardingPlanner(topology=Topology(world_size=WORLD, compute_device="cpu"), constraints=constraints)
    with pytest.raises(Exception, match="d_table"):
        stock.plan(_ebc(configs), _sharders())
    plan = _planner(configs, constraints).plan(_ebc(configs), _sharders())  # ours plans it dynamic
    assert plan.plan[""]["d_table"].compute_kernel == "customized_kernel"
    assert plan.plan[""]["n_table"].compute_kernel != "customized_kernel"


def test_unknown_dist_type_names_the_table():
    # Refused when the options are built (issue 35); one set after that, by
    # the planner, naming the table.
    with pytest.raises(ValueError, match="DynamicEmbTableOptions: unknown dist_type 'modulo'"):
        models.dynamic_constraints(["d_table"], dist_type="modulo")
    constraints = models.dynamic_constraints(["d_table"])
    constraints["d_table"].dynamicemb_options.dist_type = "modulo"
    msg = _error(models.ebc_configs(["d_table"]), constraints)
    assert "d_table" in msg and "modulo" in msg


@pytest.mark.parametrize("option,value,word", [
    ("dim", 16, "dim"), ("embedding_dtype", torch.float16, "dtype"), ("num_embeddings", 5000, "num_embeddings")])
def test_options_contradicting_the_config_name_the_table(option, value, word):
    msg = _error(models.ebc_configs(["d_table"], dim=8), models.dynamic_constraints(["d_table"], **{option: value}))
    assert "d_table" in msg and word in msg and str(value) in msg


@pytest.mark.parametrize("num_embeddings", [0, -10])
@pytest.mark.parametrize("max_capacity", [None, 1024])
def test_a_config_without_rows_names_the_table(num_embeddings, max_capacity):
    # TorchRec takes num_embeddings <= 0 when weight_init bounds are given: it
    # raised ZeroDivisionError or "math domain error" from the default initializer.
    configs = models.ebc_configs(["d_table"])
    configs[0].num_embeddings, configs[0].weight_init_min, configs[0].weight_init_max = num_embeddings, -0.1, 0.1
    msg = _error(configs, models.dynamic_constraints(["d_table"], max_capacity=max_capacity))
    assert msg.startswith(f"table 'd_table': num_embeddings={num_embeddings} must be a positive int")


def test_a_planner_without_dynamic_tables_warns():
    # Constraints left out: every table native, its large or negative ids folded to row 0 with only
    # TorchRec's range warning (which the README says to expect for dynamic tables).
    configs = models.ebc_configs(["d_table", "n_table"])
    with pytest.warns(RuntimeWarning, match=r"no table is dynamic .* all 2 tables are planned as native"):
        _planner(configs, {})


def test_a_table_too_big_for_memory_says_what_to_set():
    configs = [torchrec.EmbeddingBagConfig(name="d_table", embedding_dim=8, num_embeddings=2**40,
                                           feature_names=["f"])]
    msg = _error(configs, {"d_table": DynamicEmbParameterConstraints(use_dynamicemb=True)}, ddr_cap=2**34)
    assert msg.startswith("table 'd_table' does not fit in DDR") and "Set dynamicemb_options.max_capacity" in msg


def test_key_value_params_are_refused_by_table():
    # TorchRec's SSD / key-value kernel settings: dropped silently before.
    from torchrec.distributed.types import KeyValueParams
    constraints = models.dynamic_constraints(["d_table"])
    constraints["d_table"].key_value_params = KeyValueParams(ssd_storage_directory="/tmp/nowhere")
    msg = _error(models.ebc_configs(["d_table"]), constraints)
    assert msg.startswith("table 'd_table': key_value_params configure TorchRec's SSD") and "caching=True" in msg


def test_torchrecs_virtual_table_eviction_policy_is_refused_by_table():
    # It configures TorchRec's key-value tables; silently dropped, a TTL or
    # count policy would have been replaced by the score strategy's eviction.
    from torchrec.modules.embedding_configs import CountBasedEvictionPolicy
    configs = models.ebc_configs(["d_table"])
    configs[0].virtual_table_eviction_policy = CountBasedEvictionPolicy()
    msg = _error(configs, models.dynamic_constraints(["d_table"]))
    assert msg.startswith("table 'd_table': virtual_table_eviction_policy (CountBasedEvictionPolicy)"), msg
    assert "score_strategy" in msg


def test_dynamic_table_missing_from_the_module():
    configs = models.ebc_configs(["d_table", "e_table"])
    planner = _planner(configs, models.dynamic_constraints(["d_table", "e_table"]))
    with pytest.raises(ValueError, match="e_table"):
        planner.plan(_ebc(configs[:1]), _sharders())


def _towers(query, item):
    """Two collections in one model, as in a two-tower model."""
    towers = torch.nn.Module()
    towers.query, towers.item = _ebc(query), _ebc(item)
    return towers


def test_two_dynamic_tables_of_one_name_are_refused():
    # Two towers each with a table named id_table: the planner kept one set
    # of options by name, so the query tower's dim-8 table was built with the
    # item tower's dim 4 (its output silently 4 wide), table_stats merged the
    # two and only a dump refused them, after training.
    query = [torchrec.EmbeddingBagConfig(name="id_table", embedding_dim=8, num_embeddings=100, feature_names=["q"])]
    item = [torchrec.EmbeddingBagConfig(name="id_table", embedding_dim=4, num_embeddings=100, feature_names=["i"])]
    constraints = models.dynamic_constraints(["id_table"])
    with pytest.raises(ValueError, match="2 tables named 'id_table'; a dynamic table's name must be unique"):
        _planner(query + item, constraints)
    # The model holds both even when the configs list one.
    with pytest.raises(ValueError, match=r"modules \['query', 'item'\] each hold a table named 'id_table'"):
        _planner(query, constraints).plan(_towers(query, item), _sharders())
    # A native table may share a name, as in TorchRec.
    _planner(query + item, {}).plan(_towers(query, item), _sharders())


def test_constraints_for_unknown_table():
    msg = _error(models.ebc_configs(["d_table"]), models.dynamic_constraints(["typo_table"]))
    assert "typo_table" in msg


def test_dynamic_table_needs_our_sharder():
    configs = models.ebc_configs(["d_table"])
    planner = _planner(configs, models.dynamic_constraints(["d_table"]))
    with pytest.raises(ValueError, match="d_table.*dynamicemb.shard"):
        planner.plan(_ebc(configs), [EmbeddingBagCollectionSharder(fused_params=models.SGD)])


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_a_plan_without_our_options_is_refused_by_table(kind):
    # TorchRec's plan helpers give a table our kernel but not its options:
    # TorchRec's own "Compute kernel not supported" named neither the tables
    # nor the way out. Refused before anything is built (no process group).
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv

    configs = models.configs_of(kind, ["d_table", "n_table"])
    module = (torchrec.EmbeddingCollection(tables=configs, device=torch.device("meta")) if kind == "ec"
              else _ebc(configs))
    sharder = _sharders()[1 if kind == "ec" else 0]
    spec = {"d_table": row_wise(compute_kernel="customized_kernel"), "n_table": row_wise()}
    params = construct_module_sharding_plan(module, spec, sharder=sharder, local_size=WORLD, world_size=WORLD,
                                            device_type="cpu")
    with pytest.raises(ValueError, match=r"tables \['d_table'\] are planned with compute kernel "
                                         r"'customized_kernel' but carry no DynamicEmbTableOptions.*"
                                         r"DynamicEmbeddingShardingPlanner"):
        sharder.shard(module, params, ShardingEnv(world_size=WORLD, rank=0, pg=None))
    # Our planner's plan passes the check.
    ours = _planner(configs, models.dynamic_constraints(["d_table"])).plan(module, _sharders())
    assert sharder.checked_plan(ours.plan[""]) is ours.plan[""]


def test_not_enough_memory_names_the_tables():
    configs = models.ebc_configs(["d_table"], dim=64, num_embeddings=HUGE)
    msg = _error(configs, models.dynamic_constraints(["d_table"]), ddr_cap=2**30)
    assert "d_table" in msg and "DDR" in msg


def test_explicit_max_capacity_is_kept():
    configs = models.ebc_configs(["d_table"], dim=8, num_embeddings=HUGE)
    c = models.dynamic_constraints(["d_table"], max_capacity=1024, init_capacity=256)
    plan = _planner(configs, c, ddr_cap=2**30).plan(_ebc(configs), _sharders())
    o = plan.plan[""]["d_table"].dynamicemb_options
    assert (o.max_capacity, o.init_capacity, o.num_embeddings) == (1024, 256, HUGE)


# ---- the host tier (global_hbm_for_values) ----------------------------------------------


def test_rows_past_the_hbm_share_are_charged_to_host_memory():
    """On a CUDA topology a table's hash table always takes HBM; of its rows
    (values and optimizer state), those that its per-rank share of
    global_hbm_for_values holds take HBM (all of them without a share), the
    others DDR: a hybrid table's host part."""
    names = ["big_table", "half_table", "fits_table", "free_table", "host_table"]
    configs = models.ebc_configs(names, dim=16, num_embeddings=4096)
    world, rows = 2, get_sharded_table_capacity(4096, 2)
    row = get_table_value_bytes(1, 16)
    values = rows * row
    shares = {"big_table": world * values - 2, "half_table": world * values // 2, "fits_table": world * values,
              "host_table": 1}
    constraints = {n: models.dynamic_constraints([n], global_hbm_for_values=shares.get(n, 0))[n] for n in names}
    hbm, ddr = 2**40, 2**41
    topology = Topology(world_size=world, compute_device="cuda", hbm_cap=hbm, ddr_cap=ddr)
    planner = DynamicEmbeddingShardingPlanner(configs, topology=topology, constraints=constraints)
    planner.plan(_ebc(configs), _sharders())
    opts = planner.options
    assert all(o.num_shards == world for o in opts.values())
    assert opts["big_table"].local_hbm_for_values == values - 1
    head = {"big_table": rows - 1, "half_table": rows // 2, "fits_table": rows, "free_table": None, "host_table": 0}
    assert {n: opts[n].hbm_rows(row) for n in names} == head
    table = rows * 18  # hash table bytes per rank (keys, digests, scores, epochs)
    in_hbm = {n: values if h is None else min(h, rows) * row for n, h in head.items()}
    assert planner.tier_bytes_per_rank() == {n: (table + in_hbm[n], values - in_hbm[n]) for n in names}
    for d in planner._topology.devices:
        assert hbm - d.storage.hbm == 5 * table + sum(in_hbm.values())
        assert ddr - d.storage.ddr == 5 * values - sum(in_hbm.values())


def test_cached_tables_charge_their_cache_to_hbm_and_their_store_to_ddr(tmp_path):
    """caching=True: the device holds the cache (its rows of values and
    optimizer state, in whole buckets, and their hash table); host memory the
    backing store's key index (18 bytes of hash table and an 8-byte row
    position per slot at max_capacity) plus, for the host store, every row
    and its margin of 1/16 (a full store writes a put's rows before its
    evictions free as many).
    A file store's rows are on disk; a user's store object is not ours."""
    names = ["host_table", "file_table", "user_table"]
    configs = models.ebc_configs(names, dim=16, num_embeddings=4096)
    world, rows = 2, get_sharded_table_capacity(4096, 2)
    row_bytes = get_table_value_bytes(1, 16)
    cache = 256  # rows per rank: two buckets
    common = dict(caching=True, global_hbm_for_values=world * cache * row_bytes + world * 7)  # rounds down
    constraints = {**models.dynamic_constraints(["host_table"], **common),
                   **models.dynamic_constraints(["file_table"], storage_path=str(tmp_path), **common),
                   **models.dynamic_constraints(["user_table"], backing_store=HostStore(), **common)}
    hbm, ddr = 2**40, 2**41
    planner = DynamicEmbeddingShardingPlanner(configs, constraints=constraints,
                                              topology=Topology(world_size=world, compute_device="cuda",
                                                                hbm_cap=hbm, ddr_cap=ddr))
    planner.plan(_ebc(configs), _sharders())
    device = cache * (row_bytes + 18)
    index = rows * (18 + 8)
    host_rows = (rows + rows // 16) * row_bytes
    for d in planner._topology.devices:
        assert hbm - d.storage.hbm == 3 * device
        assert ddr - d.storage.ddr == (index + host_rows) + index
    assert planner.dynamic_bytes_per_rank() == {"host_table": device + index + host_rows,
                                                "file_table": device + index, "user_table": device}


def test_host_tier_refusals_name_the_table():
    with pytest.raises(ValueError, match="DynamicEmbTableOptions: global_hbm_for_values must be >= 0"):
        DynamicEmbTableOptions(dim=4, max_capacity=128, global_hbm_for_values=-1)  # refused when built (issue 35)
    options = DynamicEmbTableOptions(dim=4, max_capacity=128)
    options.global_hbm_for_values = -1  # or set later: validate names the table
    with pytest.raises(ValueError, match="t_table.*global_hbm_for_values must be >= 0"):
        options.validate("t_table")
    with pytest.raises(ValueError, match="t_table.*caching=True needs global_hbm_for_values > 0"):
        DynamicEmbTableOptions(dim=4, max_capacity=128, caching=True).validate("t_table")
    with pytest.raises(ValueError, match="t_table.*backing_store and storage_path are for caching=True"):
        DynamicEmbTableOptions(dim=4, max_capacity=128, storage_path="/tmp/x").validate("t_table")
    DynamicEmbTableOptions(dim=4, max_capacity=128, global_hbm_for_values=1 << 20, caching=True).validate("t_table")


def test_sizing_helpers_import_without_torchrec():
    """tests/cuda import only torch and dynamicemb: the sizing helpers come
    from the package root without importing torchrec."""
    code = ("import sys, dynamicemb; from dynamicemb import get_sharded_table_capacity, get_table_value_bytes; "
            "assert 'torchrec' not in sys.modules, 'torchrec imported'; "
            "print(get_sharded_table_capacity(1000, 3), get_table_value_bytes(10, 4))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["384", "160"]


def _allocated_bytes(m) -> int:
    """Bytes of a module's rows and hash tables (its admission counters' too)."""
    st = m.storage
    tables = [ht for ht, _ in st.groups]
    tables += [st.admission_counter(t).counts for t in range(m.num_tables) if st.admission_counter(t) is not None]
    slots = sum(getattr(ht, a).nbytes for ht in tables
                for a in ("slot_keys", "slot_digests", "slot_scores", "slot_timestamps", "slot_epochs"))
    return slots + sum(w.nbytes for w in st.weights())


@pytest.mark.parametrize("case", ["init_one_bucket", "timestamp_lfu", "admission"])
def test_the_estimate_is_what_a_table_allocates_at_its_maximum(case):
    """The reservation is what the table allocates once grown: a small
    init_capacity rounds the maximum up (it doubles exactly into it; 20096
    slots became 32768), the (TIMESTAMP, LFU) pair keeps 8 bytes more per
    slot, and an admission counter is a hash table of its own. The estimate
    left out all three (up to 1.6x under)."""
    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbScoreStrategy as S, FrequencyAdmissionStrategy
    from dynamicemb.options import KVCounter
    extra = {"init_one_bucket": dict(init_capacity=128),
             "timestamp_lfu": dict(score_strategy=(S.TIMESTAMP, S.LFU)),
             "admission": dict(admit_strategy=FrequencyAdmissionStrategy(threshold=1),
                               admission_counter=KVCounter(capacity=4096))}[case]
    configs = models.ebc_configs(["d_table"], dim=16, num_embeddings=20000)
    planner = _planner(configs, models.dynamic_constraints(["d_table"], **extra), world=1, ddr_cap=2**40)
    planner.plan(_ebc(configs), _sharders())
    m = BatchedDynamicEmbeddingTables([planner.options["d_table"]], ["d_table"])
    keys = torch.randperm(20000)
    m(keys, torch.tensor([0, keys.numel()])).sum().backward()  # every key stored: the table at its maximum
    assert m.table_stats()["d_table"]["size"] > 19000
    assert _allocated_bytes(m) == planner.dynamic_bytes_per_rank()["d_table"]


def test_planning_leaves_the_users_topology_as_it_was():
    """Our reservation used to come out of the user's Topology object, so a
    second planner given it reserved the dynamic tables twice."""
    configs = models.ebc_configs(["d_table"], dim=8, num_embeddings=HUGE)
    topology = Topology(world_size=WORLD, compute_device="cpu", ddr_cap=2**40)
    before = [(d.storage.hbm, d.storage.ddr) for d in topology.devices]
    constraints = models.dynamic_constraints(["d_table"], max_capacity=1 << 20)
    taken = []
    for _ in range(2):
        planner = DynamicEmbeddingShardingPlanner(configs, topology, constraints=constraints)
        planner.plan(_ebc(configs), _sharders())
        taken.append(2**40 - planner._topology.devices[0].storage.ddr)
        assert [(d.storage.hbm, d.storage.ddr) for d in topology.devices] == before
    assert taken[0] == taken[1] > 0


def test_options_without_use_dynamicemb_warn():
    """Options given to a table left native (use_dynamicemb=False) were
    dropped without a word."""
    from dynamicemb.planner import DynamicEmbParameterConstraints
    with pytest.warns(UserWarning, match="dynamicemb_options given with use_dynamicemb=False"):
        DynamicEmbParameterConstraints(dynamicemb_options=DynamicEmbTableOptions(max_capacity=1024))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DynamicEmbParameterConstraints()
        DynamicEmbParameterConstraints(use_dynamicemb=True, dynamicemb_options=DynamicEmbTableOptions(max_capacity=8))


def test_an_init_capacity_past_the_derived_max_capacity_names_the_table():
    from dynamicemb.planner import complete_options
    config = models.ebc_configs(["t_table"], dim=8, num_embeddings=100)[0]
    with pytest.raises(ValueError, match=r"table 't_table' \(max_capacity 128: num_embeddings 100 over 1 ranks\): "
                                         r".*init_capacity 4096 must be in \(0, max_capacity=128\]"):
        complete_options(config, DynamicEmbTableOptions(init_capacity=4096), 1)


def test_a_plan_made_for_another_num_embeddings_is_refused_by_table():
    """eb_configs that give the planner another num_embeddings than the
    module's tables: the table's capacity, initializer bounds and continuous
    routing would follow the planner's. Refused when sharding, by table."""
    from torchrec.distributed.types import ShardingEnv
    configs = models.ebc_configs(["d_table"])
    module = _ebc(configs)
    plan = _planner(models.ebc_configs(["d_table"], num_embeddings=10),
                    models.dynamic_constraints(["d_table"])).plan(module, _sharders())
    with pytest.raises(ValueError, match=r"table 'd_table': its plan's options have num_embeddings 10, the table "
                                         rf"{configs[0].num_embeddings}"):
        _sharders()[0].shard(module, plan.plan[""], ShardingEnv(world_size=WORLD, rank=0, pg=None),
                             device=torch.device("cpu"))
