"""dynamicemb end to end: a DLRM ranking model whose sparse features live in
dynamic embedding tables, trained, checkpointed, resharded and served.

    bash scripts/dev.sh example                          # 2 CPU ranks, a generated click log
    bash scripts/dev.sh example --data criteo PATH       # Criteo TSV (Kaggle train.txt, Terabyte day_N[.gz])
    bash scripts/dev.sh example --data movielens PATH    # MovieLens ratings.dat (1m, 10m) / ratings.csv (20m, 25m)
    torchrun --nproc-per-node 2 example.py               # the same job under torchrun (any env:// launcher)
    python example.py --device cuda --nproc 8            # GPUs (nccl; gloo for CPU tensors)

Every rank:
  1. builds TorchRec's DLRM (13 dense, 26 sparse features): 22 sparse features
     on dynamic tables (ids from an unbounded space; rows are inserted as ids
     arrive and the least recently trained ones evicted), the 4 small ones on
     native TorchRec tables; plans it with DynamicEmbeddingShardingPlanner and
     shards it with DistributedModelParallel;
  2. trains with TorchRec's TrainPipelineSparseDist: a progress bar, and every
     --log-every steps the loss, AUC, rows stored, evictions, failed inserts
     (with --cache F: F of each dynamic table's rows in a cache in front of
     host memory, the next batch's rows prefetched into it by TorchRec's
     prefetch pipeline; the lines add the cache's rows and hit rate);
  3. evaluates on held-out samples (AUC);
  4. checkpoints the model (dynamic tables included) and the dense optimizer
     with torch.distributed.checkpoint alone, then, for comparison (seconds,
     bytes), the dynamic tables with DynamicEmbDump, the parallel path;
  5. loads the DCP checkpoint into the model sharded over half as many ranks
     (1 from an odd number) and checks that it predicts the same;
  6. takes an incremental dump: the rows trained in the last --delta-steps steps;
  7. exports the model for serving (dynamicemb.inference + torch.export),
     serves a batch in a fresh process that imports only torch and
     dynamicemb, and checks that it predicts what eval did.
A failed check ends the run with an error. On several hosts, --out must be
a folder every rank can read and write.
"""
import argparse
import dataclasses
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn

from example_data import NATIVE_FEATURES, NATIVE_ROWS, NUM_DENSE, SPARSE_FEATURES, ClickRows, open_log

ID_SPACE = 2**40  # num_embeddings of a dynamic table: the id range it is declared for (any int64 is a legal key)
EVAL_FRACTION = 0.1  # of a file's rows (the latest), held out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", default=["generated"], metavar=("KIND", "PATH"),
                   help="generated (default), criteo PATH or movielens PATH")
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu (gloo) or cuda (a GPU per rank)")
    p.add_argument("--steps", type=int, default=600, help="training steps")
    p.add_argument("--batch-size", type=int, default=512, help="samples per rank and step")
    p.add_argument("--eval-batches", type=int, default=10, help="held-out batches (of batch-size x ranks)")
    p.add_argument("--log-every", type=int, default=100, help="steps between metrics lines")
    p.add_argument("--delta-steps", type=int, default=50, help="the incremental dump holds these last steps' rows")
    p.add_argument("--capacity", type=int, default=1 << 16, help="rows per dynamic table, over all ranks")
    p.add_argument("--dim", type=int, default=16, help="embedding dim")
    p.add_argument("--cache", type=float, default=None, metavar="FRACTION",
                   help="a cache (caching=True) of this share of --capacity per dynamic table, in front of host "
                        "memory, trained with TorchRec's prefetch pipeline as on GPUs (on the CPU it overlaps "
                        "nothing) (default: every row in memory)")
    p.add_argument("--max-rows", type=int, default=None,
                   help="rows to read from a file (default: one epoch of --steps, plus the held-out share)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
                   help="where the checkpoint, the incremental dump and the exported program go (default ./out)")
    args = p.parse_args(argv)
    kind = args.data[0]
    if kind not in ("generated", "criteo", "movielens") or len(args.data) != (1 if kind == "generated" else 2):
        p.error("--data takes 'generated', 'criteo PATH' or 'movielens PATH'")
    args.kind, args.path = kind, (args.data[1] if len(args.data) > 1 else None)
    for flag in ("nproc", "steps", "batch_size", "eval_batches", "log_every", "delta_steps", "capacity", "dim"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.cache is not None and not 0 < args.cache <= 1:
        p.error(f"--cache must be in (0, 1], got {args.cache}")
    if args.delta_steps >= args.steps:
        p.error(f"--delta-steps ({args.delta_steps}) must be below --steps ({args.steps})")
    return args


# ---- the model: TorchRec's DLRM, made dynamic by the planner's constraints --------------------


def dlrm(dim: int, device: torch.device) -> nn.Module:
    """TorchRec's DLRM (loss included: forward(Batch) -> (loss, (loss, logits, labels))), tables on meta."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM, DLRMTrain
    tables = [EmbeddingBagConfig(name=f"t_{f}", feature_names=[f], embedding_dim=dim,
                                 num_embeddings=NATIVE_ROWS if f in NATIVE_FEATURES else ID_SPACE)
              for f in SPARSE_FEATURES]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    return DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE, dense_arch_layer_sizes=[64, dim],
                          over_arch_layer_sizes=[128, 64, 1], dense_device=device))


def shard(module: nn.Module, pg: dist.ProcessGroup, device: torch.device, rows_per_rank: int,
          cache: Optional[float] = None):
    """The user's TorchRec code plus dynamicemb's constraints, planner and
    sharder; with `cache`, that share of each dynamic table's rows in a cache
    in front of host memory."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.types import ShardingEnv

    from dynamicemb import (DynamicEmbInitializerArgs, DynamicEmbInitializerMode, DynamicEmbScoreStrategy,
                            DynamicEmbTableOptions, EmbOptimType)
    from dynamicemb.planner import DynamicEmbeddingShardingPlanner, DynamicEmbParameterConstraints
    from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder

    configs = module.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    options = DynamicEmbTableOptions(
        max_capacity=rows_per_rank,  # at most; when full, a bucket's least recently trained row makes room
        init_capacity=min(rows_per_rank, 1 << 12),  # grows (doubling) as ids arrive
        score_strategy=DynamicEmbScoreStrategy.STEP,  # a row's score: the step that last trained it
        initializer_args=DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.UNIFORM, lower=-0.05, upper=0.05))
    if cache is not None:
        # The cache's bytes over all ranks (global_hbm_for_values): rows of dim values and one float of
        # row-wise Adagrad state. Every other row lives in a HostStore, which the module makes.
        row_bytes = (module.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()[0].embedding_dim
                     + 1) * 4
        options = dataclasses.replace(options, caching=True,
                                      global_hbm_for_values=int(cache * rows_per_rank * pg.size()) * row_bytes)
    constraints = {c.name: DynamicEmbParameterConstraints(use_dynamicemb=True, dynamicemb_options=options)
                   for c in configs if c.feature_names[0] not in NATIVE_FEATURES}
    fused = dict(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05)  # updates in backward
    sharder = DynamicEmbeddingBagCollectionSharder(fused_params=fused)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", pg.size()))
    topology = Topology(world_size=pg.size(), local_world_size=min(local, pg.size()), compute_device=device.type)
    plan = DynamicEmbeddingShardingPlanner(configs, topology, constraints=constraints).collective_plan(
        module, [sharder], pg)
    return DistributedModelParallel(module, env=ShardingEnv.from_process_group(pg), device=device, plan=plan,
                                    sharders=[sharder])


class ServedDLRM(nn.Module):
    """DLRM's forward over frozen tables, on plain tensors (so that serving
    needs no torchrec): dense [B, 13] and ids in TBE layout
    (values, offsets [26 B + 1], features in `feature_names` order) -> logits [B]."""

    def __init__(self, model: nn.Module):  # DLRM, its EBC replaced by to_inference
        super().__init__()
        self.tables = model.sparse_arch.embedding_bag_collection
        self.dense_arch, self.inter_arch, self.over_arch = model.dense_arch, model.inter_arch, model.over_arch
        self.feature_names = list(self.tables.feature_names)
        self.F, self.D = len(self.feature_names), model.sparse_arch.D
        order = [self.feature_names.index(f) for f in model.sparse_arch.sparse_feature_names]
        self.register_buffer("order", torch.tensor(order))

    def forward(self, dense: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        sparse = self.tables(values, offsets).view(-1, self.F, self.D).index_select(1, self.order)
        return self.over_arch(self.inter_arch(self.dense_arch(dense), sparse)).squeeze(1)


def tbe_inputs(rows: ClickRows, feature_names):
    """(dense, values, offsets) of `rows` for ServedDLRM."""
    present = rows.present.t()[[SPARSE_FEATURES.index(f) for f in feature_names]]
    ids = rows.ids.t()[[SPARSE_FEATURES.index(f) for f in feature_names]]
    lengths = present.reshape(-1).to(torch.int64)
    return rows.dense, ids[present], torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


# Runs in a fresh process: loads the exported program, serves the saved requests.
SERVE = r"""
import sys, time, torch
import dynamicemb  # registers the lookup op
program = torch.export.load(sys.argv[1]).module()
requests = torch.load(sys.argv[2])
start = time.perf_counter()
with torch.no_grad():
    answers = [program(*r) for r in requests]
ms = (time.perf_counter() - start) * 1e3
torch.save(answers, sys.argv[3])
assert "torchrec" not in sys.modules, "serving imported torchrec"
sizes = " + ".join(str(a.numel()) for a in answers)
print(f"served {sizes} samples in {ms:.1f} ms in a fresh process (imports: torch, dynamicemb)")
"""


# ---- helpers of one rank's job --------------------------------------------------------------------


def quiet():
    """TorchRec and torch.fx log warnings meant for their developers; dynamicemb's own warnings stay."""
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module="dynamicemb")
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's, raised in dynamicemb's calls
    logging.disable(logging.WARNING)


def fail(message: str):
    """Ends this rank; rank 0 says why."""
    raise SystemExit(f"[check failed] {message}" if dist.get_rank() == 0 else 1)


def check_close(what: str, err: float, device, tol: float = 1e-4) -> float:
    """Rank 0's largest prediction difference `err`, checked on every rank
    (so that a failure ends every rank, not one)."""
    t = torch.tensor([err], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    err = t.item()
    if not err <= tol:
        fail(f"{what}: predictions differ by up to {err:.3g} (tolerance {tol})")
    return err


def all_gather(t: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(pg.size())]
    dist.all_gather(out, t.contiguous(), group=pg)
    return torch.stack(out)


def binary_auc(logits: torch.Tensor, labels: torch.Tensor) -> float:
    from torchmetrics.functional.classification import binary_auroc
    return float(binary_auroc(logits, labels.long()))


def table_totals(stats: dict) -> dict:
    """Sums over table_stats' tables (the tier counters too, where tables are
    cached), and the largest table."""
    total = {k: sum(s.get(k, 0) for s in stats.values())
             for k in ("size", "capacity", "evicted", "failed", "hits", "misses", "write_backs", "cache_rows",
                       "store_rows")}
    largest = max(stats, key=lambda t: stats[t]["size"])
    total["largest"] = f"{largest}: {stats[largest]['size']:,}"
    return total


def tiers(total: dict) -> str:
    """The cache's share of the rows and of the lookups so far, where tables are cached."""
    looked = total["hits"] + total["misses"]
    if not looked:
        return ""
    return (f" | cache {total['cache_rows']:,} rows, store {total['store_rows']:,} | hits {total['hits'] / looked:.0%}"
            f" | written back {total['write_backs']:,}")


def table_grid(stats: dict, columns: int = 4) -> str:
    """Rows / evicted rows of every table that got ids, a few tables per line."""
    by_slot = sorted(stats.items(), key=lambda x: SPARSE_FEATURES.index(x[0][2:]))
    cells = [f"{t:<6}{s['size']:>8,} /{s['evicted']:>8,}" for t, s in by_slot if s["inserted"]]
    lines = ["  " + "   ".join(cells[i:i + columns]) for i in range(0, len(cells), columns)]
    empty = [t for t, s in by_slot if not s["inserted"]]
    return "\n".join(lines + ([f"  no ids: {', '.join(empty)}"] if empty else []))


class Job:
    """One rank's view of the run: process group, device, data, printing."""

    def __init__(self, args):
        from tqdm import tqdm
        self.args = args
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if args.device == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            if local_rank >= torch.cuda.device_count():
                raise SystemExit(f"--device cuda: local rank {local_rank} has no GPU "
                                 f"({torch.cuda.device_count()} on this host)")
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))  # the ranks share the machine's cores
        # On GPUs, gloo beside nccl carries the collectives on CPU tensors (gathering rows for export).
        dist.init_process_group("cuda:nccl,cpu:gloo" if self.device.type == "cuda" else "gloo")
        self.pg = dist.GroupMember.WORLD
        # A thread lock for tqdm's writes: its default adds a multiprocessing
        # lock, a named semaphore that a rank ending in os._exit (_exit_done)
        # leaves registered, and the launcher then warns of "leaked semaphore
        # objects". Ranks are separate processes with their own bars.
        tqdm.set_lock(threading.RLock())
        self.say = tqdm.write if self.rank == 0 else (lambda *_: None)

        self.B = args.batch_size
        self.G = self.B * self.world  # samples per step, over all ranks
        train_samples, eval_samples = args.steps * self.G, args.eval_batches * self.G
        max_rows = args.max_rows or -(-train_samples * 10 // 9) + eval_samples  # one epoch + the held-out share
        self.data = open_log(args.kind, args.path, train_samples, eval_samples, args.seed, max_rows, EVAL_FRACTION)
        self.eval_batches = min(args.eval_batches, len(self.data.eval) // self.G)
        if self.eval_batches < 1:
            raise SystemExit(f"{self.data.name}: {len(self.data.eval)} held-out samples, fewer than one global "
                             f"batch ({self.G})")
        self.eval_rows = self.data.eval.take(torch.arange(self.eval_batches * self.G))

    def evaluate(self, model, pg: dist.ProcessGroup) -> torch.Tensor:
        """Logits of the held-out samples (in their order), each global batch
        split over the ranks of `pg`."""
        per_rank, rest = divmod(self.G, pg.size())
        assert rest == 0, f"a batch of {self.G} does not split over {pg.size()} ranks"
        me = dist.get_rank(pg)
        logits = []
        model.eval()
        with torch.no_grad():
            for b in range(self.eval_batches):
                start = b * self.G + me * per_rank
                rows = self.eval_rows.take(torch.arange(start, start + per_rank))
                _, (_, out, _) = model(rows.batch().to(self.device))
                logits.append(out)
        return all_gather(torch.stack(logits), pg).transpose(0, 1).reshape(-1).cpu()  # [batch, rank, sample]


# ---- the stages ------------------------------------------------------------------------------------


def train(job: Job, model):
    """--steps steps with TrainPipelineSparseDist (--cache: the prefetch
    pipeline). Returns the model (its own
    forward back), the AUC of the last metrics window, the seconds taken and
    the tables' scores before the last --delta-steps steps."""
    from torchmetrics.classification import BinaryAUROC
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from tqdm import tqdm

    from dynamicemb import table_stats
    from dynamicemb.incremental_dump import get_score
    from dynamicemb.shard import PrefetchTrainPipelineSparseDist

    args, G, B = job.args, job.G, job.B
    optimizer = dense_optimizer(model)
    if args.cache is None:
        pipeline = TrainPipelineSparseDist(model, optimizer, job.device)
    else:  # the next batch's rows move from the store into the cache ahead of its forward
        pipeline = PrefetchTrainPipelineSparseDist(model, optimizer, job.device)
    batches = (job.data.train(step * G + job.rank * B, B).batch() for step in range(args.steps))
    auc = BinaryAUROC().to(job.device)  # since the last metrics line, all ranks (synced by compute())
    loss_sum, since, window_auc = torch.zeros((), device=job.device), None, float("nan")
    bar = tqdm(total=args.steps, desc="train", unit="step", disable=job.rank != 0, dynamic_ncols=True,
               mininterval=0.5)
    start = time.perf_counter()
    for step in range(args.steps):
        if step == args.steps - args.delta_steps:  # rows trained from here on get a higher score
            since = {t: s + 1 for t, s in get_score(model).items()}
        loss, logits, labels = pipeline.progress(batches)
        auc.update(logits, labels.long())
        loss_sum += loss
        bar.update()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            dist.all_reduce(loss_sum)
            window_auc = auc.compute().item()
            s = table_totals(table_stats(model, job.pg))
            loss = loss_sum.item() / job.world / (step % args.log_every + 1)
            job.say(f"step {step + 1:>6}/{args.steps} | loss {loss:.4f} | auc {window_auc:.4f} "
                    f"| rows {s['size']:,} (largest {s['largest']}) "
                    f"| evicted {s['evicted']:,} | failed {s['failed']:,}{tiers(s)}")
            auc.reset()
            loss_sum.zero_()
    bar.close()
    seconds = time.perf_counter() - start
    job.say(f"[tables] rows / evicted rows per dynamic table, over all ranks:\n"
            f"{table_grid(table_stats(model, job.pg))}")
    return pipeline.detach(), optimizer, window_auc, seconds, since


def dense_optimizer(model) -> torch.optim.Optimizer:
    """Adam over the dense layers (the tables update themselves in backward)."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    return torch.optim.Adam([p for _, p in in_backward_optimizer_filter(model.named_parameters())], lr=1e-3)


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def checkpoint(job: Job, model, optimizer) -> str:
    """The model (its state_dict() holds the dynamic tables' rows, optimizer
    state and scores) and the dense optimizer in one
    torch.distributed.checkpoint, in dense/; then the dynamic tables alone
    with DynamicEmbDump, the parallel streaming path, in dynamic/. Every rank
    writes its part of each."""
    from dynamicemb import DynamicEmbDump
    path = os.path.join(job.args.out, "checkpoint")
    if job.rank == 0:
        shutil.rmtree(os.path.join(path, "dense"), ignore_errors=True)  # DCP writes into a folder as it is
    dist.barrier()
    start = time.perf_counter()
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=os.path.join(path, "dense"))
    dcp_s, start = time.perf_counter() - start, time.perf_counter()
    DynamicEmbDump(os.path.join(path, "dynamic"), model, allow_overwrite=True)  # atomic: all or nothing
    dump_s = time.perf_counter() - start
    mb = [folder_bytes(os.path.join(path, d)) / 2**20 for d in ("dense", "dynamic")]
    job.say(f"[checkpoint] {path}, written by {job.world} rank(s) in parallel: dense/ torch.distributed.checkpoint "
            f"of the whole model and the dense optimizer {dcp_s:.2f} s, {mb[0]:.1f} MiB; dynamic/ DynamicEmbDump of "
            f"the dynamic tables {dump_s:.2f} s, {mb[1]:.1f} MiB")
    return path


def reload(job: Job, path: str, logits: torch.Tensor):
    """Loads the checkpoint into the model sharded over fewer ranks (half,
    or 1), evaluates it and checks it predicts `logits`. Returns (ranks, the
    largest logit difference)."""
    from dynamicemb import get_sharded_table_capacity
    args = job.args
    ranks = job.world // 2 if job.world % 2 == 0 else 1  # divides the global batch
    sub = dist.new_group(list(range(ranks)))  # collective: every rank takes part
    err = 0.0
    if job.rank < ranks:
        # Every row now lives on fewer ranks; a load never drops a key (it fails loudly), so the
        # tables get room for all of them and headroom for buckets that fill unevenly.
        rows_per_rank = 2 * get_sharded_table_capacity(args.capacity, ranks)
        torch.manual_seed(args.seed + 1)  # other initial weights: the checkpoint must overwrite them all
        model = shard(dlrm(args.dim, job.device), sub, job.device, rows_per_rank, args.cache)
        optimizer = dense_optimizer(model)
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            p.grad = torch.zeros_like(p)
        optimizer.step()  # zero gradients move nothing: Adam's state exists, for DCP to load into
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(path, "dense"), process_group=sub)  # every rank its share
        model.load_state_dict(state["model"])  # each dynamic table's row goes to the rank that owns its key
        optimizer.load_state_dict(state["optim"])
        err = (job.evaluate(model, sub) - logits).abs().max().item()
    err = check_close(f"the checkpoint loaded on {ranks} rank(s)", err, job.device)
    job.say(f"[reload] on {ranks} rank(s): same predictions (max |logit difference| {err:.1e})")
    return ranks, err


def delta_dump(job: Job, model, since: dict):
    """incremental_dump: the rows trained since `since` (the last
    --delta-steps steps), checked against the ids those steps fed."""
    from dynamicemb.incremental_dump import incremental_dump
    args = job.args
    delta, _ = incremental_dump(model, since, pg=job.pg)  # every rank gets every rank's rows
    first = args.steps - args.delta_steps
    fed = ClickRows.concat([job.data.train(step * job.G, job.G) for step in range(first, args.steps)])
    for t, (keys, _) in delta.items():
        j = SPARSE_FEATURES.index(t[2:])
        if not torch.isin(keys, fed.ids[:, j][fed.present[:, j]]).all():
            fail(f"the incremental dump of {t} holds keys not trained in the last {args.delta_steps} steps")
    rows = sum(k.numel() for k, _ in delta.values())
    path = os.path.join(args.out, "delta.pt")
    if job.rank == 0:
        torch.save(delta, path)
    job.say(f"[delta] {path}: {rows:,} rows trained in the last {args.delta_steps} steps")
    return path, rows


def export_and_serve(job: Job, model, logits: torch.Tensor):
    """Freezes the model for serving (to_inference: collective), exports it
    (rank 0), serves two requests (a batch, a single sample) in a fresh
    process and checks the answers equal eval's. Returns (path, largest
    logit difference)."""
    from dynamicemb.inference import export_model, to_inference
    served = to_inference(model)  # every rank gets the whole model, its tables frozen
    path = os.path.join(job.args.out, "model.pt2")
    err = 0.0
    if job.rank == 0:
        served = ServedDLRM(served.model).cpu().eval()
        n = len(job.eval_rows)
        requests = [tbe_inputs(job.eval_rows.take(torch.arange(job.G)), served.feature_names),
                    tbe_inputs(job.eval_rows.take(torch.tensor([n - 1])), served.feature_names)]
        batch = torch.export.Dim("batch", min=1)
        shapes = ({0: batch}, {0: torch.export.Dim("ids", min=0)}, {0: served.F * batch + 1})
        program = export_model(served, requests[0], shapes)  # a single-sample request runs too
        torch.export.save(program, path)
        inputs, outputs = os.path.join(job.args.out, "requests.pt"), os.path.join(job.args.out, "answers.pt")
        torch.save(requests, inputs)
        res = subprocess.run([sys.executable, "-c", SERVE, path, inputs, outputs], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.abspath(__file__))})
        if res.returncode != 0:
            fail(f"serving in a fresh process:\n{res.stderr}")
        answers = torch.load(outputs)
        err = max((answers[0] - logits[:job.G]).abs().max().item(), (answers[1] - logits[-1:]).abs().max().item())
        job.say(f"[serve] {path}: {res.stdout.strip()}")
    err = check_close("the exported program served in a fresh process", err, job.device)
    return path, err


def run(args) -> None:
    """One rank's job (see the module's doc)."""
    from dynamicemb import get_sharded_table_capacity, table_stats
    quiet()
    job = Job(args)
    start = time.perf_counter()
    data, say = job.data, job.say
    trained = args.steps * job.G
    if data.train_size is None:
        size = f"{trained:,} training samples, then {len(job.eval_rows):,} held out"
    else:
        size = (f"{data.train_size:,} training samples ({trained / data.train_size:.1f} epochs), the latest "
                f"{len(job.eval_rows):,} held out")
    say(f"[data] {data.name}: {size}" + "".join(f"; {f} = {what}" for f, what in data.labels.items()))

    torch.manual_seed(args.seed)  # the same dense initial weights on every rank
    model = shard(dlrm(args.dim, job.device), job.pg, job.device, get_sharded_table_capacity(args.capacity, job.world),
                  args.cache)
    say(f"[model] DLRM, {len(SPARSE_FEATURES) - len(NATIVE_FEATURES)} dynamic tables (up to {args.capacity:,} rows "
        f"each), {len(NATIVE_FEATURES)} native tables ({NATIVE_ROWS} rows), dim {args.dim}; {job.world} rank(s) on "
        f"{job.device.type} ({dist.get_backend()}), {job.B} samples per rank and step"
        + ("" if args.cache is None else f"; {args.cache:.0%} of each dynamic table's rows in a cache in front of "
                                          f"host memory, prefetch pipeline"))

    model, optimizer, train_auc, train_s, since = train(job, model)

    before = table_totals(table_stats(model, job.pg))["size"]
    logits = job.evaluate(model, job.pg)
    eval_auc = binary_auc(logits, job.eval_rows.labels)
    stats = table_totals(table_stats(model, job.pg))
    if stats["size"] != before:
        fail(f"evaluation inserted {stats['size'] - before} rows")
    say(f"[eval] AUC {eval_auc:.4f} on {len(logits):,} held-out samples (no row inserted)")

    ckpt = checkpoint(job, model, optimizer)
    reload_ranks, reload_err = reload(job, ckpt, logits)
    delta_path, delta_rows = delta_dump(job, model, since)
    program, serve_err = export_and_serve(job, model, logits)

    say(f"\n[summary] {args.steps} steps x {job.G} samples on {job.world} rank(s): training {train_s:.0f} s, "
        f"whole run {time.perf_counter() - start:.0f} s\n"
        f"  eval AUC      {eval_auc:.4f} ({len(logits):,} held-out samples; training, last window: {train_auc:.4f})\n"
        f"  rows          {stats['size']:,} in {len(SPARSE_FEATURES) - len(NATIVE_FEATURES)} dynamic tables "
        f"(capacity {stats['capacity']:,}), {stats['evicted']:,} evicted, {stats['failed']:,} failed inserts"
        f"{tiers(stats)}\n"
        f"  checkpoint    {ckpt} (reloaded on {reload_ranks} rank(s): max |logit difference| {reload_err:.1e})\n"
        f"  delta         {delta_path} ({delta_rows:,} rows)\n"
        f"  program       {program} (served in a fresh process: max |logit difference| {serve_err:.1e})")
    dist.destroy_process_group()


# ---- launching ------------------------------------------------------------------------------------


def _exit_done() -> None:
    """Ends a rank whose work is done and written without tearing the
    interpreter down. Gloo's worker threads may still be releasing the last
    collective's tensors; one that does so while Python shuts down is ended
    inside C++ and aborts the process (std::terminate, SIGABRT: a torch race,
    pytorch/pytorch#179291; it failed one CI run here, after every check had
    passed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    run(args)
    _exit_done()


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun: this process is one rank
        run(args)
        _exit_done()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(_spawned, args=(args.nproc, port, args), nprocs=args.nproc, start_method="spawn")
    except mp.ProcessExitedException as e:  # a failed check: the rank said why
        raise SystemExit(f"[example] {e}") from None


if __name__ == "__main__":
    main()
