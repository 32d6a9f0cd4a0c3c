"""The host's share of a training step: BatchedDynamicEmbeddingTables' forward
+ backward on a batch so small that the kernels cost next to nothing, so the
time left is Python, dispatch and the per-op set-up that every step pays.
On CUDA that overhead bounds the step (issue 32: the step is host-bound), and
it is the same Python and the same ops on the CPU, where it can be measured
without a GPU. Also lists the torch ops one step calls (each a launch, a copy
or a memset on CUDA, or more than one).

    bash scripts/dev.sh python benchmark/bench_step_overhead.py [--tables 8] [--ids 64] [--device cpu]
"""
import argparse
import collections
import statistics
import time

import torch

from _common import default_out, env_info, format_table, sync, write_json
from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbScoreStrategy, DynamicEmbTableOptions, EmbOptimType


def build(args, device):
    opts = [DynamicEmbTableOptions(dim=args.dim, max_capacity=args.capacity, init_capacity=args.capacity,
                                   score_strategy=DynamicEmbScoreStrategy.TIMESTAMP) for _ in range(args.tables)]
    m = BatchedDynamicEmbeddingTables(opts, optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.01, device=device)
    g = torch.Generator().manual_seed(args.seed)
    per_bag = max(1, args.ids // (args.tables * args.batch))
    idx = torch.randint(0, 4 * args.ids, (args.tables * args.batch * per_bag,), generator=g).to(device)
    off = torch.arange(0, idx.numel() + 1, per_bag).to(device)

    def step():
        out = m(idx, off)
        out.backward(torch.ones_like(out))
    return step


def ops_per_step(step):
    """{op name: calls} of the torch ops one step calls at the top level (an
    op that another op calls is not counted again)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    events = sorted((e for e in prof.events() if e.name.startswith(("aten::", "dynamicemb::"))),
                    key=lambda e: (e.time_range.start, -e.time_range.end))
    calls, open_until = collections.Counter(), -1
    for e in events:
        if e.time_range.start >= open_until:  # not inside the last top-level op
            calls[e.name] += 1
            open_until = e.time_range.end
    return dict(calls.most_common())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ids", type=int, default=64, help="ids per step, over all tables")
    ap.add_argument("--capacity", type=int, default=1 << 16, help="rows per table")
    ap.add_argument("--steps", type=int, default=200, help="steps per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=default_out("bench_step_overhead"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    step = build(args, device)
    for _ in range(args.warmup):
        step()
    sync(device)
    per_step = []
    for _ in range(args.repeats):
        s = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync(device)
        per_step.append((time.perf_counter() - s) / args.steps * 1e6)
    ops = ops_per_step(step)
    median = statistics.median(per_step)
    print(f"[step_overhead] {args.tables} tables x dim {args.dim}, {args.ids} ids a step, {device}: "
          f"{median:.0f} us a step (median of {args.repeats} x {args.steps}: "
          f"{', '.join(f'{t:.0f}' for t in per_step)}); {sum(ops.values())} torch ops a step")
    print(format_table(["op", "calls a step"], [[k, v] for k, v in ops.items()]))
    path = write_json(args.out, {"benchmark": "bench_step_overhead", "config": vars(args), "env": env_info(device),
                                 "us_per_step": median, "us_per_step_repeats": per_step,
                                 "ops_per_step": ops, "ops_per_step_total": sum(ops.values())})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
