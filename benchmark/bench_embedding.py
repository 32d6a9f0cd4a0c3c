"""Training step and eval forward of BatchedDynamicEmbeddingTables against
FBGEMM's CPU TBE (SplitTableBatchedEmbeddingBagsCodegen), same shapes and ids.

    bash scripts/dev.sh bench embedding [--steps 10] [--batch 4096] ...

Default shapes (issue 3): 8 tables, dim 64, batch 4096, pooling factor 10,
ids from Zipf(1.05) over a 10M key range (scrambled so hot ids are not
adjacent rows), EXACT_SGD and EXACT_ROWWISE_ADAGRAD (plus our ADAM alone: the
CPU TBE has no Adam). The TBE needs every row of the key range allocated:
when 8 x 10M x 64 fp32 rows do not fit in half of the machine's memory, all
features share one 10M-row table in BOTH implementations (recorded as
"layout"). A training step = forward + backward + fused optimizer update.
"""
import argparse
import os
import statistics
import time

import numpy as np
import torch

from _common import busy_warning, default_out, env_info, format_table, write_json
from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions, EmbOptimType


def zipf_batches(n_batches, n_ids, key_range, a, seed):
    """Zipf(a) ranks over [0, key_range), mapped by a fixed bijection."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, key_range + 1, dtype=np.float64) ** a
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    mult = 2654435761 % key_range
    while np.gcd(mult, key_range) != 1:
        mult += 1
    out = []
    for _ in range(n_batches):
        ranks = np.searchsorted(cdf, rng.random(n_ids))
        out.append(torch.from_numpy((ranks * mult) % key_range).to(torch.int64))
    return out


def fbgemm_tbe(num_tables, rows, dim, optimizer, lr):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * num_tables, optimizer=optimizer,
        learning_rate=lr, eps=1e-8, pooling_mode=PoolingMode.SUM)


def ours(num_tables, capacity, dim, optimizer, lr, features):
    opts = [DynamicEmbTableOptions(dim=dim, max_capacity=capacity, init_capacity=capacity)
            for _ in range(num_tables)]
    return BatchedDynamicEmbeddingTables(opts, feature_table_map=[f % num_tables for f in range(features)],
                                         optimizer=optimizer, learning_rate=lr, eps=1e-8)


def time_steps(module, batches, offsets, grad, train, warmup):
    """Median seconds of a training step (train) or an eval forward."""
    times = []
    for i, idx in enumerate(batches):
        t0 = time.perf_counter()
        if train:
            module(idx, offsets).backward(grad)
        else:
            with torch.no_grad():
                module(idx, offsets)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--pooling", type=int, default=10)
    ap.add_argument("--key-range", type=int, default=10_000_000)
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--capacity", type=int, default=1 << 22, help="our rows per table (no growth while timed)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=default_out("bench_embedding"))
    args = ap.parse_args()
    if args.device != "cpu":
        raise SystemExit("bench_embedding: only --device cpu is implemented (the CUDA backend is not built yet)")
    torch.manual_seed(0)
    device = torch.device("cpu")
    warn = busy_warning(torch.get_num_threads())
    if warn:
        print(warn)

    features = args.tables
    tbe_bytes = args.tables * args.key_range * args.dim * 4
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tables = args.tables if 2 * tbe_bytes < mem else 1
    layout = (f"{tables} tables x {args.key_range} rows" if tables == args.tables else
              f"{features} features sharing 1 table of {args.key_range} rows ({args.tables} tables would need "
              f"{tbe_bytes / 2**30:.1f} GiB)")
    n_ids = features * args.batch * args.pooling
    batches = zipf_batches(args.warmup + args.steps, n_ids, args.key_range, args.zipf, seed=0)
    offsets = torch.arange(0, n_ids + 1, args.pooling, dtype=torch.int64)
    grad = torch.randn(args.batch, features * args.dim)
    distinct = torch.cat(batches).unique().numel()
    print(f"{layout}; batch {args.batch} x {features} features x pooling {args.pooling} = {n_ids} ids per step, "
          f"{distinct} distinct ids over {len(batches)} steps")

    rows, results = [], {}
    for name in ("EXACT_SGD", "EXACT_ROWWISE_ADAGRAD", "ADAM"):
        opt = EmbOptimType[name]
        mod = ours(tables, args.capacity, args.dim, opt, 0.01, features)
        r = {"ours_train_s": time_steps(mod, batches, offsets, grad, True, args.warmup)}
        mod.eval()
        r["ours_eval_s"] = time_steps(mod, batches, offsets, grad, False, args.warmup)
        del mod
        if name != "ADAM":
            tbe = (fbgemm_tbe(tables, args.key_range, args.dim, opt, 0.01) if tables == features
                   else fbgemm_tbe_shared(features, args.key_range, args.dim, opt))
            r["tbe_train_s"] = time_steps(tbe, batches, offsets, grad, True, args.warmup)
            r["tbe_eval_s"] = time_steps(tbe, batches, offsets, grad, False, args.warmup)
            r["train_ratio"] = r["ours_train_s"] / r["tbe_train_s"]
            r["eval_ratio"] = r["ours_eval_s"] / r["tbe_eval_s"]
            del tbe
        results[name] = r
        ms = lambda k: f"{r[k] * 1e3:.1f}" if k in r else "-"  # noqa: E731
        ratio = lambda k: f"{r[k]:.2f}x" if k in r else "-"  # noqa: E731
        rows.append([name, ms("ours_train_s"), ms("tbe_train_s"), ratio("train_ratio"), ms("ours_eval_s"),
                     ms("tbe_eval_s"), ratio("eval_ratio")])
        print("  " + "  ".join(map(str, rows[-1])), flush=True)

    print()
    print(format_table(["optimizer", "ours train ms", "TBE train ms", "ratio", "ours eval ms", "TBE eval ms",
                        "ratio"], rows))
    print("target: ratio <= 1.30 for training step and eval")
    payload = {"benchmark": "bench_embedding", "config": {**vars(args), "layout": layout, "ids_per_step": n_ids,
                                                          "distinct_ids": distinct, **env_info(device)},
               "results": results}
    print(f"wrote {write_json(args.out, payload)}")


def fbgemm_tbe_shared(features, rows, dim, optimizer):
    """A TBE whose features all read one table (FBGEMM's feature_table_map)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)], feature_table_map=[0] * features,
        optimizer=optimizer, learning_rate=0.01, eps=1e-8, pooling_mode=PoolingMode.SUM)


if __name__ == "__main__":
    main()
