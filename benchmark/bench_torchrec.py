"""Training steps per second of a DMP model with dynamic tables against the
same model with TorchRec's native FUSED tables and with TorchRec's
managed-collision (MCH) module, on CPU ranks (gloo).

    bash scripts/dev.sh bench torchrec [--rows-per-table 1048576] [--batch 4096] [--steps 20]
    bash scripts/dev.sh bench torchrec --rows-per-table 65536 --batch 512 --steps 3   # smoke test
    bash scripts/dev.sh bench torchrec --key-pool 262144   # existing ids (issue 39's first target)

Default (issue 4): one EmbeddingBagCollection of 8 tables x dim 64 (SUM
pooling), one feature per table, `--pooling` ids per sample, ids drawn from
Zipf(1.05) over a 2**40 key range (inverse CDF over ranks, then a fixed
bijective scramble), different per step, rank and table, generated before
timing (torchrec_batches.py). With these ids about 75% of a step's unique
ids are new to the dynamic tables (an insert and a row init each), which
FUSED tables never pay.

Existing ids (`--key-pool N`): each table's ids are drawn Zipf(alpha) over
ranks [1, N] only (same salt and scramble: N distinct keys per table, spread
over [0, 2**40) and the ranks). Before timing, every model runs forwards
(training mode, under no_grad: no backward, no optimizer step; the dynamic
tables still store the keys) over every pool key of every table in batches
of the normal shape on all ranks, timed apart as `prefill_s`. The JSON then
gives, per round, how many of the timed steps' unique ids the dynamic tables
inserted (`results.dynamic.ids`: ~0 without --new-share), how many of them
evicted a key, and the tables' load before and after. Keep N well under
--rows-per-table (e.g. rows // 4): FUSED folds ids modulo rows (collisions
grow with N) and a dynamic table holds rows / world per rank; N > rows is
refused. `--key-pool N --new-share 0.5`: half of each step's ids are never
seen before, the rest come from the pool: new rows over a stored working
set, placed in free slots while the tables have room (with rows // 4 and
--batch 2048, 1M rows: 31% full after the pre-fill, 62% after 19 steps) and
evicting once they are full (N = rows fills them in the pre-fill). A tiny dense part (Linear(8 x 64 -> 1), BCE against random labels,
SGD) sits on top; a step = forward + backward (fused table update) + dense
SGD step. Every model gets the same row capacity per table (`--rows-per-table`,
summed over ranks), the same batches and EXACT_SGD for its tables:

  dynamic  dynamicemb tables (DynamicEmbeddingShardingPlanner: ROW_WISE,
           CUSTOMIZED_KERNEL), raw ids, max_capacity = init_capacity =
           rows / world per rank (preallocated, evicting when full).
  native   TorchRec FUSED tables (ROW_WISE), num_embeddings = rows, ids folded
           into the row range (id % rows).
  mc       ManagedCollisionEmbeddingBagCollection (MCHManagedCollisionModule
           per table, zch_size = rows, input_hash_size = 2**40, LRU eviction
           every --mc-eviction-interval steps) over the same FUSED tables,
           sharded ROW_WISE by ManagedCollisionEmbeddingBagCollectionSharder.

Each model runs on its own set of `--world` spawned processes, one after the
other, and the models take `--rounds` turns (a burst of load from elsewhere
on a shared machine then does not fall on one model only). Per step every
rank times forward + backward + optimizer between two barriers; a step's
time is the slowest rank's, and the result is the median over the `--steps`
steps (after `--warmup` steps) of all rounds. A model that fails (or hangs past
`--model-timeout`) is reported as n/a with the reason.

The plans are built directly (construct_module_sharding_plan + row_wise) for
native and mc: TorchRec's stock sharders offer ROW_WISE only for cuda, and the
MC sharder plans only the intersection of its EBC sharder's sharding types
with ROW_WISE (empty on cpu), so TorchRec's planner cannot plan them on cpu.
"""
import argparse
import datetime
import os
import queue as queue_mod
import resource
import socket
import statistics
import time
import traceback

import torch

from _common import busy_warning, default_out, env_info, format_table, loadavg, write_json
from torchrec_batches import (KEY_RANGE, check_key_pool, dynamic_counts, folded, fused_target, id_counts,
                              make_batches, mode_label, prefill, timed_counts)

MODELS = ("dynamic", "native", "mc")

# ---- models ---------------------------------------------------------------------------------


def table_configs(args, num_embeddings):
    import torchrec

    return [torchrec.EmbeddingBagConfig(name=f"t{t}", embedding_dim=args.dim, num_embeddings=num_embeddings,
                                        feature_names=[f"f{t}"], pooling=torchrec.PoolingType.SUM)
            for t in range(args.tables)]


class Net(torch.nn.Module):
    """Pooled embeddings (an EBC or an MC-EBC) -> Linear -> BCE loss."""

    def __init__(self, sparse, width, mc, device):
        super().__init__()
        self.sparse = sparse
        self.mc = mc
        self.dense = torch.nn.Linear(width, 1, device=device)

    def forward(self, kjt, labels):
        if self.mc:
            pooled, _ = self.sparse(kjt)  # (embeddings, remapped features or None)
        else:
            pooled = self.sparse(kjt)
        logits = self.dense(pooled.values()).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


def fused_params(args):
    from dynamicemb import EmbOptimType

    return dict(optimizer=EmbOptimType.EXACT_SGD, learning_rate=args.lr)


def build_dynamic(args, world):
    import torchrec  # noqa: F401
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology

    from dynamicemb import (DynamicEmbInitializerArgs, DynamicEmbInitializerMode, DynamicEmbScoreStrategy,
                            DynamicEmbTableOptions)
    from dynamicemb.planner import DynamicEmbeddingShardingPlanner, DynamicEmbParameterConstraints
    from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder

    configs = table_configs(args, KEY_RANGE)
    meta = torch.device("meta")
    model = Net(torchrec.EmbeddingBagCollection(tables=configs, device=meta), args.tables * args.dim, False, meta)
    per_rank = -(-args.rows_per_table // world)
    # New keys' rows: uniform in +-sqrt(1 / rows), the bounds TorchRec's default init_fn gives the native
    # tables (which initialise every row at construction, outside the timed steps).
    bound = (1.0 / args.rows_per_table) ** 0.5
    init = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode[args.dynamic_init.upper()],
                                     lower=-bound, upper=bound, std_dev=bound)
    opts = DynamicEmbTableOptions(max_capacity=per_rank, init_capacity=per_rank, initializer_args=init,
                                  score_strategy=DynamicEmbScoreStrategy.TIMESTAMP)
    constraints = {c.name: DynamicEmbParameterConstraints(use_dynamicemb=True, dynamicemb_options=opts)
                   for c in configs}
    fused = fused_params(args)
    sharder = DynamicEmbeddingBagCollectionSharder(fused_params=fused)
    planner = DynamicEmbeddingShardingPlanner(configs, Topology(world_size=world, compute_device="cpu"),
                                              constraints=constraints, optimizer=fused["optimizer"])
    plan = planner.collective_plan(model, [sharder])
    o = planner.options[configs[0].name]
    desc = {
        "tables": "dynamicemb (ROW_WISE, CUSTOMIZED_KERNEL via DynamicEmbeddingShardingPlanner)",
        "num_embeddings": KEY_RANGE, "ids": "raw keys in [0, 2**40)",
        "max_capacity_per_rank": o.max_capacity, "init_capacity_per_rank": o.init_capacity,
        "bucket_capacity": o.bucket_capacity, "max_load_factor": o.max_load_factor,
        "score_strategy": DynamicEmbScoreStrategy(o.score_strategy).name, "dist_type": o.dist_type,
        "initializer": f"{args.dynamic_init} (bounds +-{bound:.3g})" if args.dynamic_init != "constant"
        else "constant 0",
        "optimizer": "EXACT_SGD (fused_params)", "learning_rate": args.lr,
    }
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    return dmp, desc


def _rw_plan(module, sharder, world):
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise

    params = sharder.shardable_parameters(module)
    return construct_module_sharding_plan(
        module, {n: row_wise(compute_kernel=EmbeddingComputeKernel.FUSED.value) for n in params},
        sharder=sharder, local_size=world, world_size=world, device_type="cpu")


def build_native(args, world):
    import torchrec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan

    configs = table_configs(args, args.rows_per_table)
    meta = torch.device("meta")
    model = Net(torchrec.EmbeddingBagCollection(tables=configs, device=meta), args.tables * args.dim, False, meta)
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params(args))
    plan = ShardingPlan({"sparse": _rw_plan(model.sparse, sharder, world)})
    desc = {
        "tables": "TorchRec EmbeddingBagCollection, FUSED kernel (FBGEMM CPU TBE), ROW_WISE",
        "num_embeddings": args.rows_per_table, "ids": "key % num_embeddings",
        "rows_per_rank": -(-args.rows_per_table // world),
        "optimizer": "EXACT_SGD (fused_params)", "learning_rate": args.lr,
    }
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    return dmp, desc


MC_POLICIES = ("lru", "lfu", "distance_lfu")


def build_mc(args, world):
    import torchrec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        LFU_EvictionPolicy,
        LRU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    policy = {"lru": LRU_EvictionPolicy, "lfu": LFU_EvictionPolicy,
              "distance_lfu": DistanceLFU_EvictionPolicy}[args.mc_policy]
    cpu, meta = torch.device("cpu"), torch.device("meta")
    configs = table_configs(args, args.rows_per_table)
    mcc = ManagedCollisionCollection(
        {c.name: MCHManagedCollisionModule(zch_size=args.rows_per_table, device=cpu, eviction_policy=policy(),
                                           eviction_interval=args.mc_eviction_interval,
                                           input_hash_size=KEY_RANGE, name=c.name)
         for c in configs}, configs)
    mc_ebc = ManagedCollisionEmbeddingBagCollection(torchrec.EmbeddingBagCollection(tables=configs, device=meta),
                                                    mcc, return_remapped_features=False)
    model = Net(mc_ebc, args.tables * args.dim, True, meta)
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(
        ebc_sharder=EmbeddingBagCollectionSharder(fused_params=fused_params(args)))
    plan = ShardingPlan({"sparse": _rw_plan(model.sparse, sharder, world)})
    desc = {
        "tables": "ManagedCollisionEmbeddingBagCollection: MCHManagedCollisionModule per table over a TorchRec "
                  "EBC, FUSED kernel (FBGEMM CPU TBE), ROW_WISE, ManagedCollisionEmbeddingBagCollectionSharder",
        "num_embeddings": args.rows_per_table, "zch_size": args.rows_per_table,
        "input_hash_size": KEY_RANGE, "ids": "raw keys in [0, 2**40) (routed by input_hash_size / world)",
        "eviction_policy": policy.__name__, "eviction_interval": args.mc_eviction_interval,
        "optimizer": "EXACT_SGD (fused_params of the EBC sharder)", "learning_rate": args.lr,
    }
    dmp = DistributedModelParallel(model, device=cpu, plan=plan, sharders=[sharder])
    return dmp, desc


BUILDERS = {"dynamic": build_dynamic, "native": build_native, "mc": build_mc}


# ---- one model on `world` ranks -------------------------------------------------------------


def quiet():
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def start_rank(rank, world, port, args) -> None:
    """A spawned rank's set-up: quiet logs, its threads, the gloo group, the seed."""
    import torch.distributed as dist

    quiet()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.collective_timeout))
    torch.manual_seed(args.seed)


def model_batches(name, args, rank):
    """This rank's batches for a model: raw ids, folded into the row range for native."""
    batches = make_batches(args, rank, args.warmup + args.steps)
    return folded(batches, args.rows_per_table) if name == "native" else batches


def dense_sgd(model, args) -> torch.optim.Optimizer:
    """SGD over the model's dense part (the tables update in backward)."""
    dense = [p for n, p in model.named_parameters() if ".dense." in f".{n}"]
    if not dense:
        raise RuntimeError("no dense parameters found")
    return torch.optim.SGD(dense, lr=args.lr)


def train_step(model, opt, kjt, labels) -> torch.Tensor:
    """The timed step: forward, backward (the tables update here: fused
    EXACT_SGD), the dense SGD step. Returns the loss."""
    loss = model(kjt, labels)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def rank_main(name, rank, world, port, args, queue):
    import torch.distributed as dist

    result = {}
    try:
        start_rank(rank, world, port, args)
        t0 = time.perf_counter()
        model, desc = BUILDERS[name](args, world)
        result["build_s"] = time.perf_counter() - t0
        result["config"] = desc
        batches = model_batches(name, args, rank)
        opt = dense_sgd(model, args)
        result["prefill_s"] = [prefill(name, model, args, rank, world)]
        counts = [dynamic_counts(name, model)]  # after the pre-fill, before the timed steps, at the end
        model.train()
        times, cpu_times, faults, losses = [], [], [], []
        for i, (kjt, labels) in enumerate(batches):
            if i == args.warmup:
                counts.append(dynamic_counts(name, model))
            dist.barrier()
            f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c = time.process_time()
            s = time.perf_counter()
            loss = train_step(model, opt, kjt, labels)
            dt = time.perf_counter() - s
            dc = time.process_time() - c
            df = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
            if i >= args.warmup:
                times.append(dt)
                cpu_times.append(dc)
                faults.append(df)
            losses.append(float(loss))
        result["times_s"] = times
        result["cpu_times_s"] = cpu_times
        result["minor_faults"] = faults
        result["loss_first_last"] = [losses[0], losses[-1]]
        result.update(model_state(name, model))
        if name == "dynamic":
            counts.append(dynamic_counts(name, model))
            result["counts"] = [timed_counts(counts, batches, args, world)]
        dist.barrier()
    except Exception as e:  # reported as n/a with the reason
        tb = traceback.extract_tb(e.__traceback__)
        where = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in tb[-4:]]
        result["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        result["error_where"] = where
        result["error_time"] = time.time()
        result["traceback"] = traceback.format_exc()
    queue.put((rank, result))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def model_state(name, model):
    """A few facts about the tables after the run (this rank's)."""
    if name == "dynamic":
        from dynamicemb import table_stats

        s = table_stats(model)
        return {"table_stats": {k: sum(v[k] for v in s.values()) for k in ("size", "capacity", "inserted",
                                                                          "evicted", "failed")}}
    if name == "mc":
        mcc = model.module.sparse._managed_collision_collection
        slots = mcc.open_slots() if hasattr(mcc, "open_slots") else {}
        return {"mc_open_slots": int(sum(int(v) for v in slots.values()))}
    return {}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_model(name, args):
    """{rank: result} of one model on `world` fresh processes."""
    return run_ranks(rank_main, args, name)


def run_ranks(target, args, *lead):
    """{rank: result} of target(*lead, rank, world, port, args, queue) on
    `world` fresh processes (each puts (rank, result) on the queue)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(*lead, r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    per_rank = {}
    deadline = time.monotonic() + args.model_timeout
    while len(per_rank) < args.world and time.monotonic() < deadline:
        try:
            r, res = q.get(timeout=1.0)
            per_rank[r] = res
        except queue_mod.Empty:
            if not any(p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()) if len(per_rank) == args.world else 5.0)
        if p.is_alive():
            p.kill()
            p.join()
    for r, p in enumerate(procs):
        if r not in per_rank:
            per_rank[r] = {"error": f"rank {r} gave no result (exit code {p.exitcode}; timeout "
                                    f"{args.model_timeout}s or crash)"}
    return per_rank


def summarize(name, per_rank, args):
    errors = {r: v["error"] for r, v in per_rank.items() if "error" in v}
    out = {"config": next((v["config"] for v in per_rank.values() if "config" in v), None)}
    if errors:
        # A rank that fails makes its peers fail in a collective (connection closed, timeout):
        # report the root cause, i.e. the earliest error that is not such an echo.
        echo = ("connection closed", "connection reset", "timed out", "timeout", "gave no result")

        def key(kv):
            r, msg = kv
            return (any(e in msg.lower() for e in echo), per_rank[r].get("error_time", float("inf")), r)

        first = sorted(errors.items(), key=key)
        out["status"] = "n/a"
        out["reason"] = f"rank {first[0][0]}: {first[0][1]}"
        out["errors_per_rank"] = {r: {k: per_rank[r].get(k) for k in ("error", "error_where", "traceback")}
                                  for r in errors}
        return out
    steps = list(zip(*[per_rank[r]["times_s"] for r in sorted(per_rank)]))
    step_max = [max(s) for s in steps]  # a step ends when its slowest rank does
    med = statistics.median(step_max)
    cpu = [max(s) for s in zip(*[per_rank[r]["cpu_times_s"] for r in sorted(per_rank)])]
    faults = [max(s) for s in zip(*[per_rank[r]["minor_faults"] for r in sorted(per_rank)])]
    out.update(status="ok", median_step_s=med, steps_per_s=1.0 / med, min_step_s=min(step_max),
               step_s=step_max, samples_per_s=args.batch * args.world / med,
               median_step_cpu_s=statistics.median(cpu), step_cpu_s=cpu,
               median_step_faults=statistics.median(faults), step_faults=faults,
               per_rank={r: {k: v for k, v in per_rank[r].items() if k != "config"} for r in per_rank})
    if args.key_pool:
        pre = [max(s) for s in zip(*[per_rank[r]["prefill_s"] for r in sorted(per_rank)])]
        out.update(prefill_s=statistics.median(pre), prefill_s_rounds=pre)
    if "counts" in per_rank[0]:
        out["ids"] = [id_counts([per_rank[r]["counts"][i] for r in sorted(per_rank)], args)
                      for i in range(len(per_rank[0]["counts"]))]
    return out


def pooled(rounds):
    """One model's per-rank results of several rounds as one run: the step
    times of all rounds (a round with an error stands for all of them)."""
    for per_rank in rounds:
        if any("error" in v for v in per_rank.values()):
            return per_rank
    out = {r: dict(v) for r, v in rounds[0].items()}
    for r in out:
        for key in ("times_s", "cpu_times_s", "minor_faults", "prefill_s", "counts"):
            if key in out[r]:
                out[r][key] = [t for per_rank in rounds for t in per_rank[r][key]]
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rows-per-table", type=int, default=1 << 20,
                    help="row capacity of each table, over all ranks (dynamic: rows/world per rank)")
    ap.add_argument("--batch", type=int, default=4096, help="samples per rank per step")
    ap.add_argument("--pooling", type=int, default=10, help="ids per sample per feature")
    ap.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    ap.add_argument("--new-share", type=float, default=0.0,
                    help="share of each step's ids replaced by ids never seen before (new rows; they evict once "
                         "the tables are full, e.g. with --key-pool equal to --rows-per-table)")
    ap.add_argument("--key-pool", type=int, default=0,
                    help="existing-ids mode: each table's ids drawn from N keys only, all stored by a pre-fill "
                         "before timing; keep N well under --rows-per-table (e.g. rows // 4). 0: Zipf over 2**40")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (the median is reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2,
                    help="the models run in turn this many times; each one's steps of all rounds are pooled")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: CPUs / world)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
    ap.add_argument("--dynamic-init", choices=("uniform", "normal", "constant"), default="uniform",
                    help="initializer of new dynamic rows (constant: a diagnostic of the initialisation's cost)")
    ap.add_argument("--mc-policy", choices=MC_POLICIES, default="lru")
    ap.add_argument("--mc-eviction-interval", type=int, default=1)
    ap.add_argument("--model-timeout", type=float, default=1800.0, help="seconds before a model is given up")
    ap.add_argument("--collective-timeout", type=float, default=300.0, help="gloo timeout, seconds")
    ap.add_argument("--out", default=default_out("bench_torchrec"))
    args = ap.parse_args(argv)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.world)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        ap.error(f"unknown models {bad}; choose among {MODELS}")
    why = check_key_pool(args, args.world)
    if why:
        ap.error(why)
    return args


def header(tag, args, rounds) -> list:
    """Prints the run's settings (after a warning when the machine is busy);
    returns the load average at the start."""
    la0 = loadavg()
    warn = busy_warning(args.threads * args.world)
    if warn:
        print(warn)
    print(f"[{tag}] {args.tables} tables x dim {args.dim}, {args.rows_per_table} rows per table, "
          f"{args.world} ranks x {args.threads} thread(s), batch {args.batch}/rank x pooling {args.pooling}, "
          f"{args.warmup} warmup + {args.steps} timed steps{rounds}; load average {la0}\n  ids: {ids_mode(args)}",
          flush=True)
    return la0


def ids_mode(args):
    """The ids, in words (the header and the JSON)."""
    if args.key_pool:
        s = (f"existing ids: Zipf({args.alpha}) over a pool of {args.key_pool} keys per table (scrambled into "
             f"[0, 2**40)), every pool key stored by a pre-fill (forwards) before timing")
    else:
        s = f"Zipf({args.alpha}) over [0, 2**40) (truncated power-law inverse CDF, fixed scramble)"
    if args.new_share:
        s += f"; {100 * args.new_share:g}% of each step's ids replaced by ids never seen before"
    return s


def main(argv=None):
    args = parse_args(argv)
    models = args.models

    la0 = header("torchrec", args, "")
    runs = {name: [] for name in models}
    for rnd in range(args.rounds):
        for name in models:
            if runs[name] and summarize(name, runs[name][-1], args)["status"] != "ok":
                continue  # failed in an earlier round: reported as such
            t0 = time.perf_counter()
            runs[name].append(run_model(name, args))
            r = summarize(name, runs[name][-1], args)
            tail = (f"{r['median_step_s'] * 1e3:.1f} ms/step" if r["status"] == "ok" else f"n/a: {r['reason']}")
            if r["status"] == "ok" and args.key_pool:
                tail += f", pre-fill {r['prefill_s']:.1f} s"
            if r["status"] == "ok" and "ids" in r:
                c = r["ids"][-1]
                tail += (f", new ids in the timed steps {c['new_ids_timed']} of {c['unique_ids_timed']} unique, "
                         f"{c['evicted_timed']} evicting (load {c['load_factor_timed'][0]:.2f} -> "
                         f"{c['load_factor_timed'][1]:.2f})")
            print(f"  round {rnd + 1}: {name:<8} {tail}  ({time.perf_counter() - t0:.0f} s in all, "
                  f"load {loadavg()})", flush=True)
    results = {name: summarize(name, pooled(runs[name]), args) for name in models}

    def ok(m):
        return m in results and results[m]["status"] == "ok"

    ratios = {}
    if ok("dynamic") and ok("native"):
        ratios["dynamic_over_native_time"] = results["dynamic"]["median_step_s"] / results["native"]["median_step_s"]
    if ok("dynamic") and ok("mc"):
        ratios["dynamic_over_mc_time"] = results["dynamic"]["median_step_s"] / results["mc"]["median_step_s"]
    rows = []
    for name in models:
        r = results[name]
        if r["status"] == "ok":
            rel = ("-" if not ok("dynamic")
                   else f"{results['dynamic']['median_step_s'] / r['median_step_s']:.2f}")
            rows.append([name, f"{r['median_step_s'] * 1e3:.1f}", f"{r['min_step_s'] * 1e3:.1f}",
                         f"{r['median_step_cpu_s'] * 1e3:.1f}", f"{r['median_step_faults']:.0f}",
                         f"{r['steps_per_s']:.2f}", f"{r['samples_per_s']:.0f}", rel, ""])
        else:
            rows.append([name, "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", r["reason"][:100]])
    print()
    print(format_table(["model", "median ms", "min ms", "cpu ms", "faults/step", "steps/s", "samples/s",
                        "dyn/this time", "note"], rows))
    if "dynamic_over_native_time" in ratios:
        print(f"dynamic / native step time: {ratios['dynamic_over_native_time']:.2f} "
              f"(target {fused_target(args.key_pool, args.new_share)})")
    if "dynamic_over_mc_time" in ratios:
        print(f"dynamic / mc step time: {ratios['dynamic_over_mc_time']:.2f} (target < 1)")
    for a, b in (("native", "dynamic_over_native_cpu"), ("mc", "dynamic_over_mc_cpu")):
        if ok("dynamic") and ok(a):
            ratios[b] = results["dynamic"]["median_step_cpu_s"] / results[a]["median_step_cpu_s"]
    cpu_ratios = [f"dynamic / {k.split('_')[2]} {v:.2f}" for k, v in ratios.items() if k.endswith("_cpu")]
    if cpu_ratios:
        print("process CPU time per step (less sensitive to other load): " + ", ".join(cpu_ratios))
    la1 = loadavg()
    print(f"load average: start {la0}, end {la1}")
    info = env_info(torch.device("cpu"))
    info["threads"] = args.threads
    info["loadavg_end"] = la1
    payload = {"benchmark": "bench_torchrec", "config": {**vars(args), "models": models, **info},
               "common": {
                   "ebc": f"{args.tables} tables x dim {args.dim}, SUM pooling, one feature per table",
                   "batch_per_rank": args.batch, "pooling_factor": args.pooling,
                   "ids": ids_mode(args) + "; per step, rank and table; generated before timing",
                   "mode": mode_label(args.key_pool, args.new_share, args.rows_per_table),
                   "prefill": ("training-mode forwards under no_grad over every pool key of every table, batches "
                               "of the normal shape, all ranks, before the timed steps; prefill_s: between two "
                               "barriers, slowest rank, median over rounds" if args.key_pool else "none"),
                   "ids_counts": "dynamic: results.dynamic.ids per round, table_stats summed over ranks and "
                                 "tables; new_ids_timed = inserted during the timed steps, unique_ids_timed = "
                                 "distinct (table, id) of the timed steps' global batches, summed over steps",
                   "dense": f"Linear({args.tables * args.dim} -> 1), BCE-with-logits vs random labels, SGD "
                            f"lr {args.lr} (DDP over gloo)",
                   "step": "forward + backward (fused table update) + dense SGD step, between barriers; a step's "
                           "time is the slowest rank's; median over the timed steps",
                   "cpu_time": "process CPU time of a rank's step (all its threads), slowest rank, median",
                   "faults": "minor page faults of a rank's step (fresh pages the kernel maps and zeroes, a few "
                             "microseconds each on this VM: part of the step time of every model), most of any "
                             "rank, median",
               },
               "results": results, "ratios": ratios,
               "targets": {"dynamic_over_native_time": fused_target(args.key_pool, args.new_share),
                           "dynamic_over_mc_time": "< 1"}}
    print(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
