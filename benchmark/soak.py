"""Soak run: many training steps with growth, eviction, incremental dumps,
non-blocking dumps, flushes and evals interleaved; this process's RSS, open
file descriptors and threads must stay flat after a warm-up.

    bash scripts/dev.sh python benchmark/soak.py [--steps 3000] [--every 20] [--warmup 300]

One BatchedDynamicEmbeddingTables (Adam, dim --dim) with two tables:
  "grow":  in memory, init_capacity 1024 growing to --capacity rows, keys
           uniform over 4 x --capacity ids, so it grows first and then evicts
           at every step;
  "cached": caching=True over a FileStore (storage_path) that grows from
           --cache-rows to hold all 4 x --cache-rows ids, a cache of
           --cache-rows rows in front, so rows move between cache and file
           at every step (a flush writes the cache back and empties it).
Each step is a forward + backward of --batch bags of --pooling ids per table.
Interleaved (periods are options): an eval forward (module.eval(), no_grad)
every 7 steps, a flush every 25, incremental_dump every 20 (with the
threshold it returned last time), DynamicEmbDump(..., blocking=False) every
100 (waited for at the next sample or dump, so samples do not count a dump
thread that happens to be alive).

Every --every steps (between steps, no dump in flight): VmRSS and Threads
from /proc/self/status, len(os.listdir('/proc/self/fd')) and
threading.active_count(). After the run every dump is loaded into a fresh
in-memory module and its row counts checked against those at the dump
(table_stats()'s size: cache + store for the cached table).
Growth = max over samples after --warmup minus the first sample at or after
--warmup; RSS drift = peak of the last third of those samples minus the peak
of the first third (RSS saw-tooths by a few MiB with the dump cycle).
JSON -> benchmark/results/soak.json, plot -> benchmark/results/soak.png.
"""
import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS_DIR, default_out, env_info, format_table, write_json  # noqa: E402
from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbDump, DynamicEmbLoad,  # noqa: E402
                        DynamicEmbTableOptions, EmbOptimType)
from dynamicemb.incremental_dump import incremental_dump  # noqa: E402
from dynamicemb.optimizer import optimizer_code, state_width  # noqa: E402

OPT = EmbOptimType.ADAM
METRICS = ("rss_mib", "fds", "threads_py", "threads_os")


def sample() -> dict:
    rss = threads = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024.0
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return {"rss_mib": rss, "fds": len(os.listdir("/proc/self/fd")),
            "threads_py": threading.active_count(), "threads_os": threads}


def settle(handle) -> None:
    """Waits for a non-blocking dump, then for its OS thread to be gone too
    (join returns a moment before the kernel drops the task)."""
    handle.wait()
    task = f"/proc/self/task/{handle._thread.native_id}"
    deadline = time.monotonic() + 5.0
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.0005)


def make_module(dim, capacity, cache_rows, store_dir=None):
    """The soak's module; store_dir None: both tables in memory (to load dumps into)."""
    width = dim + state_width(optimizer_code(OPT), dim)
    grow = DynamicEmbTableOptions(dim=dim, init_capacity=1024, max_capacity=capacity)
    if store_dir is None:
        cached = DynamicEmbTableOptions(dim=dim, max_capacity=8 * cache_rows, init_capacity=8 * cache_rows)
    else:
        # The store holds every key (max_capacity) and grows from init_capacity; the cache holds cache_rows.
        cached = DynamicEmbTableOptions(dim=dim, max_capacity=8 * cache_rows, init_capacity=cache_rows, caching=True,
                                        global_hbm_for_values=cache_rows * width * 4, storage_path=store_dir)
    return BatchedDynamicEmbeddingTables([grow, cached], table_names=["grow", "cached"], optimizer=OPT,
                                         learning_rate=0.01, seed=1)


def batch(g, args):
    n = args.batch * args.pooling
    keys = torch.cat([torch.randint(0, 4 * args.capacity, (n,), generator=g),
                      torch.randint(0, 4 * args.cache_rows, (n,), generator=g)])
    return keys, torch.arange(0, 2 * n + 1, args.pooling, dtype=torch.int64)


def run(args, root) -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    m = make_module(args.dim, args.capacity, args.cache_rows, os.path.join(root, "store"))
    samples, dumps, events = [], [], dict(evals=0, flushes=0, incremental=0, incremental_rows=0, dumps=0)
    threshold, pending = 0, None
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        keys, offsets = batch(g, args)
        m(keys, offsets).sum().backward()
        if step % args.eval_every == 0:
            m.eval()
            with torch.no_grad():
                m(*batch(g, args))
            m.train()
            events["evals"] += 1
        if step % args.flush_every == 0:
            m.flush()
            events["flushes"] += 1
        if step % args.incremental_every == 0:
            out, nxt = incremental_dump(m, threshold)
            threshold = nxt
            events["incremental"] += 1
            events["incremental_rows"] += sum(int(k.numel()) for k, _ in out.values())
        if step % args.dump_every == 0:
            if pending is not None:
                settle(pending)
            path = os.path.join(root, f"dump{step}")
            sizes = {n: int(st["size"]) for n, st in m.table_stats().items()}  # the cached one: cache + store
            pending = DynamicEmbDump(path, m, blocking=False)
            dumps.append({"step": step, "path": path, "rows": sizes})
            events["dumps"] += 1
        if step % args.every == 0:
            if pending is not None:
                settle(pending)
                pending = None
            samples.append({"step": step, "s": time.perf_counter() - t0, **sample()})
    if pending is not None:
        settle(pending)
    stats = {n: {k: int(st.get(k, 0)) for k in ("size", "capacity", "evicted", "write_backs", "hits", "misses")}
             for n, st in m.table_stats().items()}
    m.close()
    del m
    final = sample()
    for d in dumps:  # every dump loads; its row counts are those at the call
        fresh = make_module(args.dim, args.capacity, args.cache_rows)
        DynamicEmbLoad(d["path"], fresh)
        d["loaded_rows"] = {n: int(st["size"]) for n, st in fresh.table_stats().items()}
        d["loadable"] = d["loaded_rows"] == d["rows"]
        del d["path"]
    res = summarize(args, samples, dumps, events, final, time.perf_counter() - t0)
    res["table_stats"] = stats
    return res


def summarize(args, samples, dumps, events, final, wall) -> dict:
    after = [s for s in samples if s["step"] >= args.warmup]
    base = after[0] if after else samples[-1]
    growth = {k: max(s[k] for s in after) - base[k] for k in METRICS} if after else {}
    # RSS saw-tooths with the dump/flush cycle (a few MiB): the drift compares
    # the peaks of the last and first thirds after warm-up, which a leak raises.
    third = max(1, len(after) // 3)
    drift = max(s["rss_mib"] for s in after[-third:]) - max(s["rss_mib"] for s in after[:third]) if after else 0.0
    return {"args": vars(args), "env": env_info(torch.device("cpu")), "wall_s": wall, "events": events,
            "samples": samples, "baseline": base, "growth_after_warmup": growth, "rss_drift_mib": drift,
            "last_vs_baseline": {k: samples[-1][k] - base[k] for k in METRICS},
            "final_vs_baseline": {k: final[k] - base[k] for k in METRICS}, "final_after_close": final,
            "dumps": dumps, "all_dumps_loadable": all(d["loadable"] for d in dumps)}


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [s["step"] for s in res["samples"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, keys, title in zip(axes, (("rss_mib",), ("fds",), ("threads_py", "threads_os")),
                               ("RSS (MiB)", "open fds", "threads")):
        for k in keys:
            ax.plot(steps, [s[k] for s in res["samples"]], label=k, marker=".")
        ax.axvline(res["args"]["warmup"], color="grey", ls="--", lw=0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
        if len(keys) > 1:
            ax.legend()
    fig.suptitle(f"soak: {res['args']['steps']} steps, max growth after warm-up "
                 + ", ".join(f"{k} {v:+.1f}" for k, v in res["growth_after_warmup"].items())
                 + f"; RSS drift {res['rss_drift_mib']:+.1f} MiB", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300, help="samples before this step are not checked")
    ap.add_argument("--every", type=int, default=20, help="sample every this many steps")
    ap.add_argument("--eval-every", type=int, default=7)
    ap.add_argument("--flush-every", type=int, default=25)
    ap.add_argument("--incremental-every", type=int, default=20)
    ap.add_argument("--dump-every", type=int, default=100, help="non-blocking DynamicEmbDump every this many steps")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--pooling", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=8192, help="max rows of the growing table")
    ap.add_argument("--cache-rows", type=int, default=2048)
    ap.add_argument("--dir", default=None, help="where the store and dumps go (default: a temporary directory)")
    ap.add_argument("--out", default=default_out("soak"))
    ap.add_argument("--png", default=os.path.join(RESULTS_DIR, "soak.png"))
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = tempfile.mkdtemp(prefix="dynamicemb-soak-", dir=args.dir)
    try:
        res = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [[s["step"], f"{s['rss_mib']:.1f}", s["fds"], s["threads_py"], s["threads_os"]]
            for s in res["samples"]]
    print(format_table(["step", "rss MiB", "fds", "py threads", "os threads"], rows))
    print(f"events {res['events']}; wall {res['wall_s']:.1f} s")
    print("max growth after warm-up (step >= %d, vs the first sample there): %s" % (args.warmup,
                                                                                   res["growth_after_warmup"]))
    print(f"RSS drift (peak of the last third after warm-up - peak of the first): {res['rss_drift_mib']:+.2f} MiB")
    print("after close, vs baseline: %s; every dump loadable: %s" % (res["final_vs_baseline"],
                                                                      res["all_dumps_loadable"]))
    if args.out:
        write_json(args.out, res)
    if args.png:
        os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
        plot(res, args.png)
    return res


if __name__ == "__main__":
    main()
