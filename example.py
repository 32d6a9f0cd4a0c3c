"""dynamicemb end to end: a DLRM ranking model whose sparse features live in
dynamic embedding tables, trained, checkpointed, resharded and served.

    bash scripts/dev.sh example                          # 2 CPU ranks, a generated click log
    bash scripts/dev.sh example --data criteo PATH       # Criteo TSV (Kaggle train.txt, Terabyte day_N[.gz])
    bash scripts/dev.sh example --data movielens PATH    # MovieLens ratings.dat (1m, 10m) / ratings.csv (20m, 25m)
    torchrun --nproc-per-node 2 example.py               # the same job under torchrun (any env:// launcher)
    python example.py --device cuda --nproc 8            # GPUs, nccl

Every rank:
  1. builds TorchRec's DLRM (13 dense, 26 sparse features): 22 sparse features
     on dynamic tables (ids from an unbounded space; rows are inserted as ids
     arrive and the least recently trained ones evicted), the 4 small ones on
     native TorchRec tables; plans it with DynamicEmbeddingShardingPlanner and
     shards it with DistributedModelParallel;
  2. trains with TorchRec's TrainPipelineSparseDist: a progress bar, and every
     --log-every steps the loss, AUC, rows stored, evictions, failed inserts;
  3. evaluates on held-out samples (AUC);
  4. checkpoints: DynamicEmbDump (dynamic tables, every rank its shard) and
     torch.distributed.checkpoint (dense layers, native tables);
  5. loads the checkpoint into the model sharded over half as many ranks and
     checks that it predicts the same;
  6. takes an incremental dump: the rows trained in the last --delta-steps steps;
  7. exports the model for serving (dynamicemb.inference + torch.export),
     serves a batch in a fresh process that imports only torch and
     dynamicemb, and checks that it predicts what eval did.
A failed check ends the run with an error.
"""
import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings

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
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu (gloo) or cuda (nccl)")
    p.add_argument("--steps", type=int, default=600, help="training steps")
    p.add_argument("--batch-size", type=int, default=512, help="samples per rank and step")
    p.add_argument("--eval-batches", type=int, default=10, help="held-out batches (of batch-size x ranks)")
    p.add_argument("--log-every", type=int, default=100, help="steps between metrics lines")
    p.add_argument("--delta-steps", type=int, default=50, help="the incremental dump holds these last steps' rows")
    p.add_argument("--capacity", type=int, default=1 << 16, help="rows per dynamic table, over all ranks")
    p.add_argument("--dim", type=int, default=16, help="embedding dim")
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


def shard(module: nn.Module, pg: dist.ProcessGroup, device: torch.device, rows_per_rank: int):
    """The user's TorchRec code plus dynamicemb's constraints, planner and sharder."""
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
    needs neither torchrec nor fbgemm): dense [B, 13] and ids in TBE layout
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


# Runs in a fresh process: loads the exported program and serves the saved batch.
SERVE = r"""
import sys, time, torch
import dynamicemb  # registers the lookup op
program = torch.export.load(sys.argv[1]).module()
inputs = torch.load(sys.argv[2])
start = time.perf_counter()
with torch.no_grad():
    logits = program(*inputs)
ms = (time.perf_counter() - start) * 1e3
torch.save(logits, sys.argv[3])
assert "torchrec" not in sys.modules, "serving imported torchrec"
print(f"served {logits.numel()} samples in {ms:.1f} ms (imports: torch, dynamicemb)")
"""


# ---- one rank's job ------------------------------------------------------------------------------


def check_close(what: str, err: float, device, tol: float = 1e-4) -> float:
    """Rank 0's largest prediction difference `err`, checked on every rank
    (so that a failure ends every rank, not one)."""
    t = torch.tensor([err], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    err = t.item()
    if not err <= tol:
        raise SystemExit(f"[check failed] {what}: predictions differ by up to {err:.3g} (tolerance {tol})")
    return err


def quiet():
    """TorchRec and torch.fx log warnings meant for their developers; dynamicemb's own warnings stay."""
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module="dynamicemb")
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's, raised in dynamicemb's calls
    logging.disable(logging.WARNING)


def all_gather(t: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(pg.size())]
    dist.all_gather(out, t.contiguous(), group=pg)
    return torch.stack(out)


def evaluate(model, rows: ClickRows, batches: int, pg: dist.ProcessGroup, device) -> torch.Tensor:
    """Logits of the first `batches` global batches of `rows` (in their
    order), the ranks of `pg` each predicting their share of every batch."""
    per_rank = len(rows) // batches // pg.size()
    me = dist.get_rank(pg)
    logits = []
    model.eval()
    with torch.no_grad():
        for b in range(batches):
            start = (b * pg.size() + me) * per_rank
            _, (_, out, _) = model(rows.take(torch.arange(start, start + per_rank)).batch().to(device))
            logits.append(out)
    return all_gather(torch.stack(logits), pg).transpose(0, 1).reshape(-1).cpu()  # [batch, rank, sample]


def binary_auc(logits: torch.Tensor, labels: torch.Tensor) -> float:
    from torchmetrics.functional.classification import binary_auroc
    return float(binary_auroc(logits, labels.long()))


def table_totals(stats: dict) -> dict:
    total = {k: sum(s[k] for s in stats.values()) for k in ("size", "capacity", "evicted", "failed")}
    total["largest"] = max(stats, key=lambda t: stats[t]["size"])
    return total


def run(args) -> None:
    from torchmetrics.classification import BinaryAUROC
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from tqdm import tqdm

    from dynamicemb import DynamicEmbDump, DynamicEmbLoad, table_stats
    from dynamicemb.incremental_dump import get_score, incremental_dump
    from dynamicemb.inference import to_inference

    quiet()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))  # the ranks share the machine's cores
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    pg = dist.GroupMember.WORLD
    say = tqdm.write if rank == 0 else (lambda *_: None)
    t0 = time.perf_counter()

    B, G = args.batch_size, args.batch_size * world
    train_samples, eval_samples = args.steps * G, args.eval_batches * G
    max_rows = args.max_rows or -(-train_samples * 10 // 9) + eval_samples
    data = open_log(args.kind, args.path, train_samples, eval_samples, args.seed, max_rows, EVAL_FRACTION)
    eval_batches = min(args.eval_batches, len(data.eval) // G)
    if eval_batches < 1:
        raise SystemExit(f"{data.name}: {len(data.eval)} held-out samples, fewer than one batch ({G})")
    eval_rows = data.eval.take(torch.arange(eval_batches * G))
    feature_labels = "".join(f", {f} = {what}" for f, what in data.labels.items())
    size = f"{data.train_size:,} training samples" if data.train_size else "unbounded"
    say(f"[data] {data.name}: {size}, {len(eval_rows):,} held out{feature_labels}")

    torch.manual_seed(args.seed)  # the same dense initial weights on every rank
    model = shard(dlrm(args.dim, device), pg, device, -(-args.capacity // world))
    dense_params = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    optimizer = torch.optim.Adam(dense_params, lr=1e-3)  # the dense layers; the tables update themselves
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    say(f"[model] DLRM, {len(SPARSE_FEATURES) - len(NATIVE_FEATURES)} dynamic tables (up to {args.capacity:,} rows "
        f"each), {len(NATIVE_FEATURES)} native tables ({NATIVE_ROWS} rows), dim {args.dim}; {world} rank(s) on "
        f"{device.type} ({dist.get_backend()}), {B} samples per rank and step")

    # ---- 2. train -------------------------------------------------------------------------------
    batches = (data.train(step * G + rank * B, B).batch() for step in range(args.steps))
    auc = BinaryAUROC().to(device)  # over the steps since the last metrics line, all ranks (synced on compute)
    loss_sum, since, window_auc = torch.zeros((), device=device), None, float("nan")
    bar = tqdm(total=args.steps, desc="train", unit="step", disable=rank != 0, dynamic_ncols=True)
    t_train = time.perf_counter()
    for step in range(args.steps):
        if step == args.steps - args.delta_steps:  # rows trained from the next step on have a higher score
            since = {t: s + 1 for t, s in get_score(model).items()}
        loss, logits, labels = pipeline.progress(batches)
        auc.update(logits, labels.long())
        loss_sum += loss
        bar.update()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            n = (step % args.log_every) + 1
            dist.all_reduce(loss_sum)
            window_auc = auc.compute().item()
            s = table_totals(table_stats(model, pg))
            say(f"step {step + 1:>6}/{args.steps} | loss {loss_sum.item() / world / n:.4f} | auc {window_auc:.4f} "
                f"| rows {s['size']:,} (largest {s['largest']}) | evicted {s['evicted']:,} | failed {s['failed']:,}")
            auc.reset()
            loss_sum.zero_()
    bar.close()
    train_s = time.perf_counter() - t_train
    model = pipeline.detach()  # the model's own forward back, for eval

    # ---- 3. evaluate ----------------------------------------------------------------------------
    before = table_totals(table_stats(model, pg))
    logits = evaluate(model, eval_rows, eval_batches, pg, device)
    eval_auc = binary_auc(logits, eval_rows.labels)
    after = table_totals(table_stats(model, pg))
    say(f"[eval] AUC {eval_auc:.4f} on {len(eval_rows):,} held-out samples "
        f"(rows inserted by eval: {after['size'] - before['size']})")

    # ---- 4. checkpoint: dynamic tables (DynamicEmbDump) + dense part and native tables (DCP) -----
    ckpt = os.path.join(args.out, "checkpoint")
    if rank == 0:
        shutil.rmtree(os.path.join(ckpt, "dense"), ignore_errors=True)
    dist.barrier()
    DynamicEmbDump(os.path.join(ckpt, "dynamic"), model, allow_overwrite=True)
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(ckpt, "dense"))
    say(f"[checkpoint] {ckpt}: dynamic/ (DynamicEmbDump, {world} shards), dense/ (torch.distributed.checkpoint)")

    # ---- 5. load it on another number of ranks, evaluate again ----------------------------------
    new_world = max(1, world // 2)
    sub = dist.new_group(list(range(new_world)))
    reload_err = 0.0
    if rank < new_world:
        # Every row now lives on fewer ranks; a load never drops a key (it fails loudly), so give
        # the tables room for all of them and headroom for buckets filling unevenly.
        rows = 2 * -(-args.capacity // new_world)
        torch.manual_seed(args.seed + 1)  # different initial weights: the checkpoint must overwrite them all
        reloaded = shard(dlrm(args.dim, device), sub, device, rows)
        DynamicEmbLoad(os.path.join(ckpt, "dynamic"), reloaded, pg=sub)
        state = reloaded.state_dict()
        dcp.load(state, checkpoint_id=os.path.join(ckpt, "dense"), process_group=sub)
        reloaded.load_state_dict(state)
        again = evaluate(reloaded, eval_rows, eval_batches, sub, device)
        reload_err = (again - logits).abs().max().item()
        del reloaded
    err = check_close(f"the checkpoint loaded on {new_world} rank(s)", reload_err, device)
    say(f"[reload] on {new_world} rank(s): same predictions (max |logit difference| {err:.1e})")

    # ---- 6. incremental dump: the rows trained in the last --delta-steps steps ---------------------
    delta, _ = incremental_dump(model, since, pg=pg)  # every rank gets every rank's rows
    fed = {f"t_{f}": [] for f in SPARSE_FEATURES}
    for step in range(args.steps - args.delta_steps, args.steps):
        rows_ = data.train(step * G, G)
        for j, f in enumerate(SPARSE_FEATURES):
            fed[f"t_{f}"].append(rows_.ids[:, j][rows_.present[:, j]])
    for t, (keys, _) in delta.items():
        if not torch.isin(keys, torch.cat(fed[t])).all():
            raise SystemExit(f"[check failed] incremental dump of {t}: holds keys not trained in the last "
                             f"{args.delta_steps} steps")
    delta_rows = sum(k.numel() for k, _ in delta.values())
    if rank == 0:
        torch.save({t: (k, v) for t, (k, v) in delta.items()}, os.path.join(args.out, "delta.pt"))
    say(f"[delta] {delta_rows:,} rows trained in the last {args.delta_steps} steps "
        f"({delta_rows / max(1, after['size']):.0%} of all rows): {os.path.join(args.out, 'delta.pt')}")

    # ---- 7. export for serving, serve a batch in a fresh process -----------------------------
    served = to_inference(model)  # collective: every rank gets the whole model, its tables frozen
    program_path = os.path.join(args.out, "model.pt2")
    serve_err = 0.0
    if rank == 0:
        served = ServedDLRM(served.model).cpu().eval()
        batch = tbe_inputs(eval_rows.take(torch.arange(G)), served.feature_names)
        D = torch.export.Dim("batch", min=1)
        shapes = ({0: D}, {0: torch.export.Dim("ids", min=0)}, {0: served.F * D + 1})
        torch.export.save(torch.export.export(served, batch, dynamic_shapes=shapes), program_path)
        inputs, outputs = os.path.join(args.out, "serve_input.pt"), os.path.join(args.out, "serve_output.pt")
        torch.save(batch, inputs)
        res = subprocess.run([sys.executable, "-c", SERVE, program_path, inputs, outputs], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.abspath(__file__))})
        if res.returncode != 0:
            raise SystemExit(f"[check failed] serving in a fresh process:\n{res.stderr}")
        serve_err = (torch.load(outputs) - logits[:G]).abs().max().item()
        say(f"[serve] {program_path}: {res.stdout.strip()}")
    err_served = check_close("the exported program served in a fresh process", serve_err, device)

    # ---- summary --------------------------------------------------------------------------------
    stats = table_totals(table_stats(model, pg))
    say(f"\n[summary] {args.steps} steps x {G} samples on {world} rank(s) in {train_s:.0f} s "
        f"(whole run {time.perf_counter() - t0:.0f} s)\n"
        f"  eval AUC      {eval_auc:.4f} ({len(eval_rows):,} held-out samples; training, last window: "
        f"{window_auc:.4f})\n"
        f"  rows          {stats['size']:,} in {len(SPARSE_FEATURES) - len(NATIVE_FEATURES)} dynamic tables "
        f"(capacity {stats['capacity']:,}), {stats['evicted']:,} evicted, {stats['failed']:,} failed inserts\n"
        f"  checkpoint    {ckpt} (reloaded on {new_world} rank(s): max |logit difference| {err:.1e})\n"
        f"  delta         {os.path.join(args.out, 'delta.pt')} ({delta_rows:,} rows)\n"
        f"  program       {program_path} (served in a fresh process: max |logit difference| {err_served:.1e})")
    dist.destroy_process_group()


# ---- launching ------------------------------------------------------------------------------------


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    run(args)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun: this process is one rank
        run(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_spawned, args=(args.nproc, port, args), nprocs=args.nproc, start_method="spawn")


if __name__ == "__main__":
    main()
