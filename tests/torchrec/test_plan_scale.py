"""benchmark/plan_scale.py: every plan it makes fits its own budgets, by an
account made here from the plan's tables and options (not the planner's
accounting), and the planner refuses, naming the table, what cannot fit."""
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmark"))
import plan_scale  # noqa: E402

from dynamicemb.optimizer import EmbOptimType  # noqa: E402

F32 = 4
SLOT = 8 + 8 + 1 + 1          # a hash table slot: key, score, digest, epoch
HOST_INDEX_SLOT = SLOT + 8    # a backing store's key index: a slot plus the row's position
BUCKET = 128
# Optimizer state columns per row (FBGEMM's definitions): one accumulator per
# row for row-wise Adagrad, two moments per element for Adam.
STATE = {EmbOptimType.EXACT_ROWWISE_ADAGRAD.name: lambda d: 1, EmbOptimType.ADAM.name: lambda d: 2 * d}


def store_room(cap: int) -> int:
    """The slots of a backing store's key index for a table of `cap` rows:
    from 1024 slots (8 buckets), doubling exactly into its maximum, the
    table's whole buckets rounded up to a multiple of 8 x 2^k."""
    buckets, start, k = -(-cap // BUCKET), 1024 // BUCKET, 0
    while buckets >> (k + 1) >= start:
        k += 1
    return -(-buckets // 2**k) * 2**k * BUCKET


def account(plan, world: int, optimizer: str):
    """(HBM, host) bytes per rank of a plan, from its tables' options: a
    table keeps its hash table in HBM, and its rows (values and state) there
    up to its per-rank budget (all without one), the others in host memory;
    a cached table keeps its cache
    (budget / row bytes, whole buckets, at least one bucket, at most every
    row) and the cache's hash table in HBM, and its store's room of rows
    (plus the HostStore's margin of 1/16) and their key index in host memory."""
    hbm = host = 0
    for name, ps in plan.plan[""].items():
        o = ps.dynamicemb_options
        assert o.num_shards == world and ps.ranks == list(range(world))
        assert o.max_capacity * world >= o.num_embeddings, name  # every key has a row
        row = (o.dim + STATE[optimizer](o.dim)) * F32
        cap, per_rank = o.max_capacity, o.global_hbm_for_values // world
        if o.caching:
            cached = min(cap, max(BUCKET, per_rank // row // BUCKET * BUCKET))
            hbm += cached * (row + SLOT)
            room = store_room(cap)
            host += room * HOST_INDEX_SLOT + (room + room // 16) * row
        else:  # the rows that the per-rank budget holds in HBM, the others in host memory
            head = cap if o.global_hbm_for_values == 0 else min(cap, per_rank // row)
            hbm += cap * SLOT + head * row
            host += (cap - head) * row
    return hbm, host


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan_scale.json"
    return plan_scale.main(["--out", str(out), "--dump-rate", "1e9"])


def test_every_plan_fits_its_budgets(cases):
    assert len(cases) == len(plan_scale.WORLDS) * len(plan_scale.KEYS) * len(plan_scale.OPTIMIZERS)
    assert any(c["fits"] for c in cases) and any(not c["fits"] for c in cases)
    for c in cases:
        world = c["world"]
        sizes = plan_scale.zipf_sizes(c["keys"])
        assert sum(sizes) == c["keys"] and len(sizes) == 26
        optimizer = EmbOptimType[c["optimizer"]]
        options = plan_scale.choose_options(sizes, world, optimizer)
        host_per_rank = plan_scale.HOST_PER_NODE // plan_scale.GPUS_PER_NODE
        if not c["fits"]:
            continue
        _, plan = plan_scale.plan_case(sizes, world, optimizer, options)
        hbm, host = account(plan, world, c["optimizer"])
        assert hbm <= plan_scale.hbm_budget() < 80 * 2**30, (world, c["keys"], c["optimizer"])
        assert host <= host_per_rank == 256 * 2**30
        assert (hbm, host) == (c["hbm_used"], c["ddr_used"])  # the planner charged what we count
        assert all(o.dim == 128 for o in (ps.dynamicemb_options for ps in plan.plan[""].values()))


def test_refused_cases_are_those_that_do_not_fit(cases):
    """A case the planner refuses needs more than a rank has, by the same
    independent account (made on the plan with the host limit lifted)."""
    for c in cases:
        if c["fits"]:
            continue
        sizes, optimizer = plan_scale.zipf_sizes(c["keys"]), EmbOptimType[c["optimizer"]]
        _, plan = plan_scale.plan_case(sizes, c["world"], optimizer, host_per_node=2**62)
        hbm, host = account(plan, c["world"], c["optimizer"])
        assert hbm > 80 * 2**30 or host > 256 * 2**30
        assert re.match(r"table 't\d\d' does not fit in (HBM|DDR)", c["refusal"]), c["refusal"]


def test_ten_billion_adam_keys_on_eight_gpus_are_refused_by_name():
    """10B keys, dim 128, Adam (1536 B a row) on 8 GPUs: each rank would hold
    1.25B rows (1.9 TB) in 256 GiB of host memory. The planner names the
    first table that does not fit and its bytes against what is left."""
    sizes = plan_scale.zipf_sizes(10**10)
    with pytest.raises(ValueError) as e:
        plan_scale.plan_case(sizes, 8, EmbOptimType.ADAM)
    msg = str(e.value)
    m = re.match(r"table '(t\d\d)' does not fit in DDR: it needs (\d+) bytes of DDR per rank .* has (\d+) of its "
                 r"(\d+) bytes left", msg)
    assert m, msg
    name, need, left, have = m[1], int(m[2]), int(m[3]), int(m[4])
    assert have == 256 * 2**30 and need > left
    cap = -(-sizes[int(name[1:])] // 8)
    cap = -(-cap // BUCKET) * BUCKET
    room = store_room(cap)
    assert need == room * HOST_INDEX_SLOT + (room + room // 16) * (128 + 2 * 128) * F32  # rows and key index


def test_a_single_table_too_big_for_hbm_is_named():
    """All-HBM options (no budget) on a table larger than a GPU: refused in
    HBM, naming that table and not the small one before it."""
    sizes = [10**6, 10**9]
    with pytest.raises(ValueError, match=r"table 't01' does not fit in HBM: it needs \d+ bytes of HBM per rank "
                                         r"\(its values, optimizer state and hash table"):
        plan_scale.plan_case(sizes, 8, EmbOptimType.ADAM, options={n: plan_scale.DynamicEmbTableOptions()
                                                                  for n in plan_scale.table_names(2)})


def test_all_to_all_formula():
    world, b = 8, plan_scale.BATCH // 8
    a = plan_scale.all_to_all_bytes(world)
    assert a["fwd_pooled"] == a["bwd_grads"] == 7 * b * 26 * 128 * 4
    assert a["fwd_ids"] == 7 * b * 26 // 8 * 8 + b * 26 * 4 * 7
    assert a["total"] == a["fwd_ids"] + 2 * a["fwd_pooled"]


def test_docs_table_is_the_scripts(cases):
    """docs/scale.md's results table is the script's output (every column
    but the checkpoint seconds, which follow the measured dump rate)."""
    text = open(plan_scale.DOC).read()
    block = re.search(r"<!-- plan_scale:begin.*?-->\n(.*?)\n\n", text, flags=re.S)[1].splitlines()[2:]
    doc = [[cell.strip() for cell in line.strip("|").split("|")][:-1] for line in block]
    assert doc == [[str(x) for x in row][:-1] for row in plan_scale.summary_rows(cases)]
