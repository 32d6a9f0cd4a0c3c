"""Dump and load rates of a dynamic table against torch.save of the same bytes.

    bash scripts/dev.sh bench checkpoint [--rows 10000000] [--world 2] [--dir /tmp/x]

Default (issue 5): one table of 10M rows x dim 64 with Adam state (3 x 64
floats per row), split over 2 ranks (gloo). Each rank: fills its table
(keys arange(rank, rows, world)), dumps it (timed, every rank writing in
parallel; the dump fsyncs its files) and writes the same number of bytes with
plain torch.save followed by an fsync (timed): --repeats such pairs, which
goes first alternating; the times are the medians, the rate ratio the median
of the pairs' ratios (issue 39: side by side, medians of alternating
repeats). Then it loads the dump into a fresh table (timed). Peak extra memory during the
dump is sampled from /proc/self/statm (RSS) every 2 ms.

Then the same rows in a TorchRec model (an EBC with that one dynamic table,
sharded by DistributedModelParallel, roundrobin routing so that each rank
holds its own keys) are checkpointed both ways and loaded into a fresh model
(timed, bytes on disk): DynamicEmbDump / DynamicEmbLoad, and
torch.distributed.checkpoint (dcp.save(model.state_dict()); dcp.load into the
fresh model's state_dict(), then load_state_dict). `--no-dcp` skips this part.
"""
import argparse
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import busy_warning, default_out, env_info, format_table, write_json
from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbDump, DynamicEmbLoad, DynamicEmbTableOptions, EmbOptimType
from dynamicemb.storage_protocol import RowBatch

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRss:
    """Samples this process's RSS in a thread; `extra` = peak - start."""

    def __enter__(self):
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())
        self.extra = self.peak - self.start


def table(rows_per_rank, dim):
    cap = 1 << max(7, (int(rows_per_rank / 0.6) - 1).bit_length())  # load factor <= 0.6: no bucket overflows
    o = DynamicEmbTableOptions(dim=dim, max_capacity=cap, init_capacity=cap, max_load_factor=1.0,
                               score_strategy=1)  # STEP
    return BatchedDynamicEmbeddingTables([o], table_names=["t"], optimizer=EmbOptimType.ADAM)


def timed_collective(fn):
    # Each phase starts with no dirty pages left by the previous one: otherwise
    # whichever writes second is throttled by the first one's writeback.
    os.sync()
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def save_durably(obj, path):
    """torch.save, then fsync: the dump fsyncs its files, so the baseline does too."""
    torch.save(obj, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sharded_model(rows_per_rank, dim, world):
    """An EBC with the one dynamic table "t" (Adam), sharded over the world."""
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology

    from dynamicemb.planner import DynamicEmbeddingShardingPlanner, DynamicEmbParameterConstraints
    from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder

    cap = table(rows_per_rank, dim).table_options[0].max_capacity
    configs = [torchrec.EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=2**40, feature_names=["f"])]
    opts = DynamicEmbTableOptions(max_capacity=cap, init_capacity=cap, max_load_factor=1.0, score_strategy=1,
                                  dist_type="roundrobin")
    fused = dict(optimizer=EmbOptimType.ADAM)
    sharder = DynamicEmbeddingBagCollectionSharder(fused_params=fused)
    planner = DynamicEmbeddingShardingPlanner(configs, Topology(world_size=world, compute_device="cpu"),
                                              constraints={"t": DynamicEmbParameterConstraints(
                                                  use_dynamicemb=True, dynamicemb_options=opts)},
                                              optimizer=fused["optimizer"])
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    plan = planner.collective_plan(ebc, [sharder])
    return DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def compare_dcp(rank, world, keys, dim, root) -> dict:
    """DynamicEmbDump / DynamicEmbLoad against dcp.save / dcp.load + load_state_dict, same model and rows."""
    import torch.distributed.checkpoint as dcp
    from dynamicemb.stats import dynamic_modules

    n = keys.numel()
    model = sharded_model(n, dim, world)
    module = next(dynamic_modules(model))
    g = torch.Generator().manual_seed(rank)
    for s in range(0, n, 1 << 20):
        k = keys[s:s + (1 << 20)]
        module.storage.load_rows(0, RowBatch(k, torch.randn(k.numel(), dim, generator=g),
                                             torch.rand(k.numel(), 2 * dim, generator=g), torch.full_like(k, 7), None))
    out = {}
    dump, ckpt = os.path.join(root, "model_dump"), os.path.join(root, "model_dcp")
    out["model_dump_s"], _ = timed_collective(lambda: DynamicEmbDump(dump, model))
    out["dcp_save_s"], _ = timed_collective(lambda: dcp.save(model.state_dict(), checkpoint_id=ckpt))
    del model, module
    fresh = sharded_model(n, dim, world)
    out["model_load_s"], _ = timed_collective(lambda: DynamicEmbLoad(dump, fresh))
    del fresh
    fresh = sharded_model(n, dim, world)

    def load():
        sd = fresh.state_dict()
        dcp.load(sd, checkpoint_id=ckpt)
        fresh.load_state_dict(sd)
    out["dcp_load_s"], _ = timed_collective(load)
    out["dcp_loaded_all"] = next(dynamic_modules(fresh)).storage.size(0) == n
    return out


def rank_main(rank, world, port, args, root, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    keys = torch.arange(rank, args.rows, world, dtype=torch.int64)
    n, dim = keys.numel(), args.dim
    m = table(n, dim)
    g = torch.Generator().manual_seed(rank)
    for s in range(0, n, 1 << 20):  # fill: values, Adam moments, scores
        k = keys[s:s + (1 << 20)]
        m.storage.load_rows(0, RowBatch(k, torch.randn(k.numel(), dim, generator=g),
                                        torch.rand(k.numel(), 2 * dim, generator=g), torch.full_like(k, 7), None))
    # The same bytes (keys, values, optimizer state, scores) with torch.save.
    plain = {"keys": keys, "values": torch.randn(n, dim), "optimizer_state": torch.rand(n, 2 * dim),
             "scores": torch.full_like(keys, 7)}
    plain_path = os.path.join(root, f"plain_rank{rank}.pt")
    dump_s, save_s = [], []
    for r in range(args.repeats):  # alternating which goes first: both see the disk's state alike
        path = os.path.join(root, "dump")
        if r:  # the last repeat's dump stays for the load
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
            dist.barrier()

        def dump():
            with PeakRss() as mem:
                dump_s.append(timed_collective(lambda: DynamicEmbDump(path, m, chunk_rows=args.chunk_rows))[0])
            return mem.extra

        def save():
            save_s.append(timed_collective(lambda: save_durably(plain, plain_path))[0])
            os.remove(plain_path) if r + 1 < args.repeats else None

        if r % 2 == 0:
            extra = dump()
            save()
        else:
            save()
            extra = max(extra, dump())
    plain_bytes = os.path.getsize(plain_path)
    os.remove(plain_path)
    del m, plain
    m2 = table(n, dim)
    load_s, _ = timed_collective(lambda: DynamicEmbLoad(path, m2))
    ok = m2.storage.size(0) == n
    del m2
    dcp_res = compare_dcp(rank, world, keys, dim, root) if args.dcp else {}
    queue.put((rank, dict(rows=n, dump_s=dump_s, save_s=save_s, load_s=load_s, plain_bytes=plain_bytes,
                          dump_extra_rss=extra, loaded_all=ok, **dcp_res)))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--chunk-rows", type=int, default=1 << 18, help="slots scanned per part file")
    ap.add_argument("--repeats", type=int, default=3,
                    help="dump / torch.save pairs, alternating which goes first (medians reported)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--no-dcp", dest="dcp", action="store_false",
                    help="skip the DynamicEmbDump / torch.distributed.checkpoint comparison on a TorchRec model")
    ap.add_argument("--out", default=default_out("bench_checkpoint"))
    args = ap.parse_args()
    warn = busy_warning(torch.get_num_threads())
    if warn:
        print(warn)
    root = tempfile.mkdtemp(prefix="dynamicemb-bench-ckpt-", dir=args.dir)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=rank_main, args=(r, args.world, port, args, root, queue)) for r in range(args.world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        per_rank = dict(queue.get() for _ in procs)
        def folder_bytes(name):
            return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(root, name))
                       for f in fs)
        dump_bytes = folder_bytes("dump")
        model_bytes = {"model_dump_bytes": folder_bytes("model_dump"), "dcp_bytes": folder_bytes("model_dcp")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = sum(r["rows"] for r in per_rank.values())
    # Per repeat the slowest rank's time; the median over the repeats.
    dump_each = [max(r["dump_s"][i] for r in per_rank.values()) for i in range(args.repeats)]
    save_each = [max(r["save_s"][i] for r in per_rank.values()) for i in range(args.repeats)]
    dump_s, save_s = statistics.median(dump_each), statistics.median(save_each)
    load_s = max(r["load_s"] for r in per_rank.values())
    plain_bytes = sum(r["plain_bytes"] for r in per_rank.values())
    chunk_bytes = args.chunk_rows * (8 + 8 + 3 * args.dim * 4)
    res = {
        "rows": rows, "dump_bytes": dump_bytes, "plain_bytes": plain_bytes,
        "dump_s": dump_s, "dump_gb_s": dump_bytes / dump_s / 1e9, "dump_rows_s": rows / dump_s,
        "save_s": save_s, "save_gb_s": plain_bytes / save_s / 1e9,
        "load_s": load_s, "load_gb_s": dump_bytes / load_s / 1e9, "load_rows_s": rows / load_s,
        # The rate ratio of each pair (side by side), its median over the pairs.
        "dump_vs_save": statistics.median((dump_bytes / d) / (plain_bytes / v) for d, v in zip(dump_each, save_each)),
        "dump_s_each": dump_each, "save_s_each": save_each,
        "dump_extra_rss_per_rank": {r: v["dump_extra_rss"] for r, v in per_rank.items()},
        "chunk_bytes_upper_bound": chunk_bytes,
        "loaded_all": all(r["loaded_all"] for r in per_rank.values()),
    }
    if args.dcp:
        for k in ("model_dump_s", "model_load_s", "dcp_save_s", "dcp_load_s"):
            res[k] = max(r[k] for r in per_rank.values())
        res.update(model_bytes, dcp_loaded_all=all(r["dcp_loaded_all"] for r in per_rank.values()))
    print(format_table(["what", "seconds", "GB/s", "Mrows/s"], [
        ["DynamicEmbDump", f"{dump_s:.2f}", f"{res['dump_gb_s']:.2f}", f"{rows / dump_s / 1e6:.2f}"],
        ["torch.save+fsync (same bytes)", f"{save_s:.2f}", f"{res['save_gb_s']:.2f}", f"{rows / save_s / 1e6:.2f}"],
        ["DynamicEmbLoad", f"{load_s:.2f}", f"{res['load_gb_s']:.2f}", f"{rows / load_s / 1e6:.2f}"],
    ]))
    print(f"dump rate / torch.save rate: {res['dump_vs_save']:.2f}, the median over {args.repeats} alternating pairs "
          f"(target >= 1.0)")
    extra = max(res["dump_extra_rss_per_rank"].values())
    print(f"peak extra RSS during the dump: {extra / 2**20:.0f} MiB per rank (one chunk: "
          f"{chunk_bytes / 2**20:.0f} MiB); every row loaded back: {res['loaded_all']}")
    if args.dcp:
        print(f"\nThe same rows in a TorchRec model ({args.world} ranks), checkpointed and loaded into a fresh one:")
        print(format_table(["what", "save s", "load s", "MiB on disk"], [
            ["DynamicEmbDump / DynamicEmbLoad", f"{res['model_dump_s']:.2f}", f"{res['model_load_s']:.2f}",
             f"{res['model_dump_bytes'] / 2**20:.1f}"],
            ["dcp.save / dcp.load + load_state_dict", f"{res['dcp_save_s']:.2f}", f"{res['dcp_load_s']:.2f}",
             f"{res['dcp_bytes'] / 2**20:.1f}"],
        ]))
        print(f"every row loaded back through DCP: {res['dcp_loaded_all']}")
    payload = {"benchmark": "bench_checkpoint", "config": {**vars(args), **env_info(torch.device("cpu"))},
               "per_rank": per_rank, "results": res}
    print(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
