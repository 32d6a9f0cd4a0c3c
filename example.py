"""dynamicemb end to end: a TorchRec model with dynamic tables, on CPU ranks.

    bash scripts/dev.sh example                 # 2 ranks (default)
    bash scripts/dev.sh example --world-size 1 --steps 50

Each rank: plan with DynamicEmbeddingShardingPlanner (two dynamic tables, one
native table), shard with DistributedModelParallel, train a small click model
on synthetic Zipf ids drawn from a 2**40 range, evaluate (eval inserts
nothing), print the tables' counters, dump the tables in parallel, then load
the dump into a fresh model on ONE rank (resharding) and check that it gives
the same predictions.
"""
import argparse
import logging
import os
import socket
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.distributed._shard.sharded_tensor  # noqa: F401  (gathering native tables)
import torchrec
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.optim.optimizers import in_backward_optimizer_filter

from dynamicemb import (
    DynamicEmbDump,
    DynamicEmbLoad,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    EmbOptimType,
    table_stats,
)
from dynamicemb.planner import DynamicEmbeddingShardingPlanner, DynamicEmbParameterConstraints
from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder

DIM = 16
TABLES = {  # name: (num_embeddings, dynamic?)
    "user_table": (2**40, True),  # ids from an unbounded space: dynamic
    "item_table": (2**40, True),
    "category_table": (1000, False),  # a small static table stays native
}


class ClickModel(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        configs = [torchrec.EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=rows,
                                               feature_names=[n.replace("_table", "")])
                   for n, (rows, _) in TABLES.items()]
        self.ebc = torchrec.EmbeddingBagCollection(tables=configs, device=device)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM * len(TABLES), 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.configs = configs

    def forward(self, kjt):
        pooled = self.ebc(kjt)
        return self.mlp(torch.cat([pooled[k] for k in ("user", "item", "category")], dim=1)).squeeze(1)


def shard(world_size, rows_per_rank=1 << 10):
    """The user's TorchRec code, plus dynamicemb's constraints, planner and sharder."""
    model = ClickModel(torch.device("meta"))
    constraints = {name: DynamicEmbParameterConstraints(
        use_dynamicemb=True,
        dynamicemb_options=DynamicEmbTableOptions(
            max_capacity=rows_per_rank,  # far fewer than the ids seen: the oldest get evicted
            init_capacity=1 << 8,  # grows (doubling) as ids arrive
            score_strategy=DynamicEmbScoreStrategy.STEP))
        for name, (_, dynamic) in TABLES.items() if dynamic}
    fused = dict(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05)
    sharder = DynamicEmbeddingBagCollectionSharder(fused_params=fused)
    planner = DynamicEmbeddingShardingPlanner(model.configs, Topology(world_size=world_size, compute_device="cpu"),
                                              constraints=constraints, optimizer=fused["optimizer"])
    plan = planner.collective_plan(model, [sharder])
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def batch(step, rank, world_size, batch_size, seed=0):
    """Synthetic clicks: Zipf-like ids over 2**40, a click when user and item ids share a bit."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * world_size + rank)
    zipf = lambda n: ((torch.rand(n, generator=g).pow(-2.0) * 10).long() * 2654435761) % (2**40)  # noqa: E731
    users, items = zipf(batch_size), zipf(batch_size)
    cats = torch.randint(0, 1000, (batch_size,), generator=g)
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["user", "item", "category"], values=torch.cat([users, items, cats]),
        lengths=torch.ones(3 * batch_size, dtype=torch.int64))
    labels = (((users ^ items) & 1) == 0).float()
    return kjt, labels


def quiet():
    """TorchRec and torch.fx log warnings meant for their developers."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def run(rank, world_size, port, args, out_dir):
    quiet()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    model = shard(world_size)
    # Every parameter not trained in backward (the MLP, and a native table that
    # TorchRec planned DATA_PARALLEL/DENSE): fused tables update themselves.
    dense_opt = torch.optim.Adam([p for _, p in in_backward_optimizer_filter(model.named_parameters())], lr=1e-2)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    say(f"[train] {world_size} rank(s), {args.steps} steps of {args.batch_size} samples per rank")
    for step in range(args.steps):
        kjt, labels = batch(step, rank, world_size, args.batch_size)
        loss = loss_fn(model(kjt), labels)
        dense_opt.zero_grad()
        loss.backward()  # dynamic tables update their rows here (fused optimizer)
        dense_opt.step()
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            say(f"  step {step:4d}  loss {loss.item():.4f}")

    model.eval()
    before = table_stats(model, dist.group.WORLD)
    kjt, labels = batch(10_000, rank, world_size, args.batch_size)
    with torch.no_grad():
        eval_loss = loss_fn(model(kjt), labels).item()
    after = table_stats(model, dist.group.WORLD)
    say(f"[eval] loss {eval_loss:.4f}; rows inserted by eval: "
        f"{sum(after[t]['size'] - before[t]['size'] for t in after)}")
    say("[stats] summed over ranks")
    say(f"  {'table':<14}{'size':>8}{'capacity':>10}{'inserted':>10}{'evicted':>9}{'failed':>8}")
    for name, s in after.items():
        say(f"  {name:<14}{s['size']:>8}{s['capacity']:>10}{s['inserted']:>10}{s['evicted']:>9}{s['failed']:>8}")

    path = os.path.join(out_dir, "checkpoint")
    DynamicEmbDump(path, model, allow_overwrite=True)
    say(f"[dump] {path} written by {world_size} rank(s) in parallel")
    # Predictions on a fixed probe batch and the dense state (native tables
    # gathered whole), to compare after the reload.
    probe, _ = batch(20_000, 0, 1, 64)
    with torch.no_grad():
        pred = model(probe)
        dense = {}
        for k, v in model.state_dict().items():
            if isinstance(v, torch.distributed._shard.sharded_tensor.ShardedTensor):
                full = torch.empty(v.size()) if rank == 0 else None
                v.gather(dst=0, out=full)
                v = full
            dense[k] = v
    if rank == 0:
        torch.save((pred, dense), os.path.join(out_dir, "probe.pt"))
    dist.destroy_process_group()


def reload_on_one_rank(port, out_dir, world_size):
    """Loads the dump on a different world size (1 rank) and compares. The
    rank needs room for every rank's rows (a load never drops keys: it
    fails loudly when they do not fit)."""
    quiet()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = shard(1, rows_per_rank=4 * world_size << 10)
    ref_out, dense = torch.load(os.path.join(out_dir, "probe.pt"))
    with torch.no_grad():  # the dense part and the native table, as any TorchRec user restores them
        for k, v in model.state_dict().items():
            if isinstance(v, torch.distributed._shard.sharded_tensor.ShardedTensor):
                for piece in v.local_shards():
                    r0, c0 = piece.metadata.shard_offsets
                    rows, cols = piece.metadata.shard_sizes
                    piece.tensor.copy_(dense[k][r0:r0 + rows, c0:c0 + cols])
            else:
                v.copy_(dense[k])
    DynamicEmbLoad(os.path.join(out_dir, "checkpoint"), model)
    model.eval()
    probe, _ = batch(20_000, 0, 1, 64)
    with torch.no_grad():
        out = model(probe)
    err = (out - ref_out).abs().max().item()
    print(f"[load] dump of {world_size} rank(s) loaded on 1 rank: max prediction difference {err:.2e}", flush=True)
    dist.destroy_process_group()
    return err


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--out", default=None, help="where the checkpoint goes (default: a temporary directory)")
    args = ap.parse_args()
    out_dir = args.out or tempfile.mkdtemp(prefix="dynamicemb-example-")
    os.makedirs(out_dir, exist_ok=True)
    mp.start_processes(run, args=(args.world_size, free_port(), args, out_dir), nprocs=args.world_size,
                       start_method="spawn")
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:  # a fresh process: a new world of one rank
        err = pool.apply(reload_on_one_rank, (free_port(), out_dir, args.world_size))
    if err > 1e-5:
        raise SystemExit(f"reloaded predictions differ by {err}")
    print("[done] python -m dynamicemb.checkpoint", os.path.join(out_dir, "checkpoint"), "inspects the dump")


if __name__ == "__main__":
    main()
