"""Storage tiers: the training step of a module whose tables keep a cache of
their hot rows in front of a backing store (host memory or a file), against
the same module with every row in memory; and the file store's gather rate
against a plain numpy.memmap gather of the same rows.

    bash scripts/dev.sh bench tiers [--steps 60] [--warmup 20] [--batch 1024] ...
    bash scripts/dev.sh bench tiers --quick      # small settings, < 40 s

Training (CPU, one process): `--tables` tables of dim `--dim`, one feature
each, `--batch` bags of `--pooling` ids from Zipf(`--zipf`) over
`--key-range` keys (scrambled so hot ids are not adjacent), the same batches
for every module. The working set of a table is the distinct keys the run
touches; a cached module gives each table a cache of 100%, 50% or 10% of its
working set (global_hbm_for_values = those rows x row bytes), over a
HostStore or a FileStore (storage_path). A step = forward + backward with the
fused optimizer; with prefetch, `prefetch(next batch)` is called first and
counted in the step: on CPU it runs synchronously, where TorchRec's
prefetch pipeline overlaps it with the step on GPU streams. Every module
starts empty; the modules take turns step by step (load from elsewhere then
falls on all alike) and each cached module's output is checked to equal the
in-memory module's at every step. Times are medians over the steps after
`--warmup`; `--score-strategy` (TIMESTAMP_LFU: the pair, whose access times
ride in the store's rows) and `--admission-threshold` (frequency admission)
set every module's tables alike; the hit rate is the share of a forward's keys found in the cache
over those steps (new keys count as misses; `new_share` says how many).

File gather: a FileStore table of `--gather-rows` rows; `--gather-n` random
rows gathered by position through the store and through numpy.memmap
fancy indexing of a file of the same rows, same positions (both files in the
page cache). ratio = memmap rows/s / file store rows/s (the file store's time
over the baseline's).
"""
import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from _common import Op, bench_round_robin, busy_warning, default_out, env_info, format_table, write_json
from bench_embedding import zipf_batches
from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbScoreStrategy, DynamicEmbTableOptions, EmbOptimType,
                        FrequencyAdmissionStrategy, KVCounter)
from dynamicemb.optimizer import optimizer_code, state_width
from dynamicemb.tiers import FileStore, HostStore

STEP_TARGET = 1.5  # 10% cache with prefetch: step time / all-in-memory step time
GATHER_TARGET = 1.2  # file store gather time / memmap gather time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--pooling", type=int, default=4)
    ap.add_argument("--key-range", type=int, default=10_000_000)
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--steps", type=int, default=60, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first (the caches fill)")
    ap.add_argument("--optimizer", default="EXACT_ROWWISE_ADAGRAD", choices=[o.name for o in EmbOptimType])
    ap.add_argument("--backings", default="host,file", help="comma-separated: host, file")
    ap.add_argument("--score-strategy", default="TIMESTAMP", choices=["TIMESTAMP", "STEP", "LFU", "TIMESTAMP_LFU"],
                    help="every table's score strategy (TIMESTAMP_LFU: the (TIMESTAMP, LFU) pair)")
    ap.add_argument("--admission-threshold", type=int, default=0,
                    help="> 0: FrequencyAdmissionStrategy(threshold) over a KVCounter of the key range, every module")
    ap.add_argument("--fractions", default="1,0.5,0.1", help="cache sizes, as shares of the working set")
    ap.add_argument("--gather-rows", type=int, default=1 << 20)
    ap.add_argument("--gather-n", type=int, default=1 << 16, help="rows per gather")
    ap.add_argument("--gather-repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the file stores go (default: a temporary directory)")
    ap.add_argument("--quick", action="store_true", help="small settings (a smoke run for reports, < 40 s)")
    ap.add_argument("--out", default=default_out("bench_tiers"))
    args = ap.parse_args(argv)
    if args.quick:
        # 100 steps: the working set (~55 batches' distinct keys) leaves a 10% cache room for the
        # keys a step holds at once (its batch and the prefetched one).
        args.batch, args.steps, args.warmup = 512, 40, 60
        args.gather_rows, args.gather_repeats = 1 << 18, 9
    return args


# ---- training --------------------------------------------------------------------------------

def _strategy(args):
    if args.score_strategy == "TIMESTAMP_LFU":
        return (DynamicEmbScoreStrategy.TIMESTAMP, DynamicEmbScoreStrategy.LFU)
    return DynamicEmbScoreStrategy[args.score_strategy]


def make_module(args, capacity, cache_rows=None, backing=None, root=None):
    """All in memory (cache_rows None), or each table t caching cache_rows[t]
    rows in front of one HostStore ("host") or a FileStore under root ("file")."""
    host = HostStore() if backing == "host" else None
    opt = EmbOptimType[args.optimizer]
    width = args.dim + state_width(optimizer_code(opt), args.dim)
    opts = []
    for t in range(args.tables):
        o = dict(dim=args.dim, max_capacity=capacity, init_capacity=capacity, score_strategy=_strategy(args))
        if args.admission_threshold > 0:
            o.update(admit_strategy=FrequencyAdmissionStrategy(args.admission_threshold),
                     admission_counter=KVCounter(min(args.key_range, 1 << 22)))
        if cache_rows is not None:
            o.update(caching=True, global_hbm_for_values=cache_rows[t] * width * 4)
            if host is not None:
                o.update(backing_store=host)
            else:
                o.update(storage_path=root)
        opts.append(DynamicEmbTableOptions(**o))
    return BatchedDynamicEmbeddingTables(opts, table_names=[f"t{t}" for t in range(args.tables)], optimizer=opt,
                                         learning_rate=0.01, seed=1)


def tier_totals(m):
    """(hits, misses, inserted) summed over the module's tables."""
    s = m.table_stats().values()
    return (sum(x.get("hits", 0) for x in s), sum(x.get("misses", 0) for x in s),
            sum(x["inserted"] for x in s))


def run_training(args, root):
    n_ids = args.tables * args.batch * args.pooling
    batches = zipf_batches(args.warmup + args.steps, n_ids, args.key_range, args.zipf, seed=0)
    per_table = args.batch * args.pooling
    ws = [torch.cat([b[t * per_table:(t + 1) * per_table] for b in batches]).unique().numel()
          for t in range(args.tables)]
    capacity = 1 << (2 * max(ws) - 1).bit_length()  # load factor <= 0.5: the in-memory table never evicts
    offsets = torch.arange(0, n_ids + 1, args.pooling, dtype=torch.int64)
    grad = torch.randn(args.batch, args.tables * args.dim, generator=torch.Generator().manual_seed(1))

    modules = {"in_memory": make_module(args, capacity)}
    cases = []
    for backing in args.backings.split(","):
        for frac in map(float, args.fractions.split(",")):
            for prefetch in (False, True):
                name = f"{backing}/{frac:g}/{'prefetch' if prefetch else 'no prefetch'}"
                rows = [max(1, int(frac * w)) for w in ws]
                modules[name] = make_module(args, capacity, rows, backing,
                                            os.path.join(root, name.replace("/", "_").replace(" ", "_")))
                stats = modules[name].table_stats().values()
                cases.append(dict(name=name, backing=backing, cache_fraction=frac, prefetch=prefetch,
                                  cache_rows=sum(s["cache_capacity"] for s in stats)))
    prefetching = {c["name"] for c in cases if c["prefetch"]}
    for name in prefetching:
        modules[name].prefetch(batches[0], offsets)

    times = {name: [] for name in modules}
    prefetch_times = {name: [] for name in modules}
    identical = {name: True for name in modules}
    at_warmup = {}
    names = list(modules)
    for i, idx in enumerate(batches):
        if i == args.warmup:
            at_warmup = {n: tier_totals(modules[n]) for n in names}
        ref, outs = None, {}
        for name in names[i % len(names):] + names[:i % len(names)]:  # a different module first each step
            m = modules[name]
            t0 = time.perf_counter()
            if name in prefetching and i + 1 < len(batches):
                m.prefetch(batches[i + 1], offsets)
            t1 = time.perf_counter()
            out = m(idx, offsets)
            out.backward(grad)
            t2 = time.perf_counter()
            if i >= args.warmup:
                times[name].append(t2 - t0)
                prefetch_times[name].append(t1 - t0)
            if name == "in_memory":
                ref = out.detach()
            else:
                outs[name] = out.detach()
        for name in names[1:]:  # each cached module trains exactly as the in-memory one
            identical[name] &= torch.equal(outs[name], ref)
        if i % 10 == 0:
            print(f"  step {i}/{len(batches)}", flush=True)

    in_memory_s = statistics.median(times["in_memory"])
    steps = []
    for c in cases:
        m = modules[c["name"]]
        h0, m0, n0 = at_warmup[c["name"]]
        h1, m1, n1 = tier_totals(m)
        looked = (h1 - h0) + (m1 - m0)
        step_s = statistics.median(times[c["name"]])
        fwd_bwd_s = statistics.median([a - b for a, b in zip(times[c["name"]], prefetch_times[c["name"]])])
        steps.append(dict(backing=c["backing"], cache_fraction=c["cache_fraction"], prefetch=c["prefetch"],
                          step_ms=step_s * 1e3, vs_in_memory=step_s / in_memory_s,
                          prefetch_ms=statistics.median(prefetch_times[c["name"]]) * 1e3,
                          fwd_bwd_ms=fwd_bwd_s * 1e3, fwd_bwd_vs_in_memory=fwd_bwd_s / in_memory_s,
                          hit_rate=(h1 - h0) / max(1, looked), new_share=(n1 - n0) / max(1, looked),
                          cache_rows=c["cache_rows"], identical_to_in_memory=identical[c["name"]]))
    for m in modules.values():
        store = getattr(m.storage, "store", None)
        if isinstance(store, FileStore):
            store.close()
    config = dict(ids_per_step=n_ids, working_set_rows=ws, in_memory_capacity=capacity,
                  zipf_note="ids: Zipf ranks over key_range mapped by a fixed bijection (bench_embedding)")
    return in_memory_s, steps, config


# ---- file store gather -----------------------------------------------------------------------

def run_gather(args, root):
    width = args.dim + state_width(optimizer_code(EmbOptimType[args.optimizer]), args.dim)
    n = args.gather_rows
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(n, width, generator=g)
    keys = torch.randperm(n, generator=g) * 7 + 3
    store = FileStore(os.path.join(root, "gather"))
    store.open_table("g", width, torch.float32, 2 * n)  # room: no key evicted from the index
    for s in range(0, n, 1 << 16):  # puts of a cache's write-back size
        store.put("g", keys[s:s + (1 << 16)], rows[s:s + (1 << 16)], torch.zeros(min(1 << 16, n - s),
                                                                               dtype=torch.int64))
    store.flush()
    table = store._file("g")
    want = keys[torch.randint(0, n, (args.gather_n,), generator=g)].unique()
    want = want[torch.randperm(want.numel(), generator=g)]
    found, positions, _ = table.index.find(want)
    assert bool(found.all())
    # The baseline: a file of the same rows in the same places, gathered by numpy.memmap fancy indexing.
    base_path = os.path.join(root, "memmap.rows")
    file_rows = torch.zeros(table.rows, width)
    file_rows[positions] = table.gather(positions)
    file_rows.numpy().tofile(base_path)
    mm = np.memmap(base_path, dtype=np.float32, mode="r", shape=(table.rows, width))
    pos_np = positions.numpy()
    assert np.array_equal(mm[pos_np], table.gather(positions).numpy())
    ops = [Op("file_store", lambda _: table.gather(positions)),
           Op("memmap", lambda _: mm[pos_np]),
           Op("file_store_read", lambda _: store.read("g", want))]
    res = bench_round_robin(ops, positions.numel(), torch.device("cpu"), args.gather_repeats, warmup=2)
    store.close()
    del mm
    fs, base, read = (res[k].rate for k in ("file_store", "memmap", "file_store_read"))
    return dict(rows_per_s=fs, memmap_rows_per_s=base, ratio=base / fs, read_rows_per_s=read,
                rows=positions.numel(), file_rows=table.rows, row_bytes=width * 4)


# ---- main ------------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warn = busy_warning(args.threads)
    if warn:
        print(warn)
    root = tempfile.mkdtemp(prefix="bench_tiers_", dir=args.dir)
    try:
        t0 = time.perf_counter()
        in_memory_s, steps, train_config = run_training(args, root)
        t_train = time.perf_counter() - t0
        gather = run_gather(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = [[s["backing"], f"{s['cache_fraction']:.0%}", "on" if s["prefetch"] else "off", f"{s['step_ms']:.2f}",
             f"{s['prefetch_ms']:.2f}" if s["prefetch"] else "-", f"{s['vs_in_memory']:.2f}x",
             f"{s['fwd_bwd_vs_in_memory']:.2f}x" if s["prefetch"] else "-", f"{s['hit_rate']:.3f}", f"{s['new_share']:.3f}",
             "yes" if s["identical_to_in_memory"] else "NO"] for s in steps]
    print()
    print(f"all in memory: {in_memory_s * 1e3:.2f} ms/step; working set {train_config['working_set_rows']} rows "
          f"per table; {args.steps} timed steps after {args.warmup} ({t_train:.0f} s)")
    print(format_table(["backing", "cache", "prefetch", "step ms", "of it prefetch", "vs memory", "w/o prefetch", "hit rate", "new keys",
                        "same output"], rows))
    print("prefetch(next batch) runs before each forward; on CPU it runs synchronously inside the step (counted "
          "in 'step ms'); TorchRec's prefetch pipeline overlaps it with the step on GPU streams ('w/o prefetch': "
          "forward + backward alone)")
    print()
    print(f"file store gather: {gather['rows_per_s'] / 1e6:.2f} M rows/s, numpy.memmap {gather['memmap_rows_per_s'] / 1e6:.2f} "
          f"M rows/s (ratio {gather['ratio']:.2f}); read by key (index + gather) "
          f"{gather['read_rows_per_s'] / 1e6:.2f} M rows/s; {gather['rows']} rows of {gather['row_bytes']} bytes "
          f"from {gather['file_rows']}")

    targets = {}
    for backing in args.backings.split(","):
        s = next((x for x in steps if x["backing"] == backing and x["cache_fraction"] == 0.1 and x["prefetch"]),
                 None)
        if s is None:
            continue
        # The step with its synchronous prefetch; w/o_prefetch: as a pipeline overlapping it would see.
        targets[f"step_{backing}_10pct_prefetch"] = dict(value=s["vs_in_memory"], target=STEP_TARGET,
                                                           met=s["vs_in_memory"] <= STEP_TARGET,
                                                           without_prefetch=s["fwd_bwd_vs_in_memory"])
    targets["file_gather"] = dict(value=gather["ratio"], target=GATHER_TARGET, met=gather["ratio"] <= GATHER_TARGET)
    for k, v in targets.items():
        extra = (f" (forward + backward alone, the prefetch overlapped: {v['without_prefetch']:.2f}x)"
                 if "without_prefetch" in v else "")
        print(f"target {k}: {v['value']:.2f}x <= {v['target']}x: {'met' if v['met'] else 'BELOW TARGET'}{extra}")
    if not all(s["identical_to_in_memory"] for s in steps):
        print("ERROR: a cached module's output differed from the in-memory module's")

    config = {**{k: v for k, v in vars(args).items() if k != "out"}, **train_config,
              "step": "prefetch(next batch) if on + forward + backward (fused optimizer), ms, median; "
                      "prefetch_ms: the prefetch call alone (synchronous on CPU); fwd_bwd_ms: the step less "
                      "its prefetch (what a pipeline that overlaps the prefetch would see)",
              "hit_rate": "forward keys found in the cache / forward keys, timed steps",
              "ratio": "memmap_rows_per_s / rows_per_s (target <= 1.2)"}
    payload = {"env": env_info(torch.device("cpu")), "config": config, "steps": steps,
               "in_memory_step_ms": in_memory_s * 1e3, "file_gather": gather, "targets": targets}
    print(f"wrote {write_json(args.out, payload)}")
    if not all(s["identical_to_in_memory"] for s in steps):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
