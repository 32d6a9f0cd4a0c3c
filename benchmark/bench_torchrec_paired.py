"""bench_torchrec's dynamic and native (FUSED) models in the same ranks, step
by step: a paired measurement of their step-time ratio.

    bash scripts/dev.sh python benchmark/bench_torchrec_paired.py --rows-per-table 1048576 --batch 2048 \\
        --key-pool 262144 [--new-share 0.5] [--steps 16] [--rounds 3]

bench_torchrec runs each model in its own processes, one after the other:
on a shared machine its rounds of one build spread over 2x, which hides a
ratio's last 10%. Here every rank builds both models (same tables, ids,
pre-fill, dense part and step as bench_torchrec: its builders and batches),
and step i of the one runs right after step i of the other, the order
alternating (dynamic first on even steps), so that a burst of load or a
slow phase of the machine falls on both (on a shared 2-core VM its rounds'
medians still spread over about +-6%). Per step and model a step's time
is the slowest rank's (between barriers); the result is the median over
the timed steps of all rounds of the per-step ratio dynamic / native, with
its quartiles, and the ratio of the two models' median step times. Each
round runs on fresh processes. Each round also says what the dynamic tables
did in its timed steps (bench_torchrec's counters): new ids stored, how many
of them evicted a key, and the tables' load before and after.
"""
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_torchrec as B  # noqa: E402
from _common import default_out, env_info, format_table, loadavg, write_json  # noqa: E402
from torchrec_batches import dynamic_counts, fused_target, id_counts, mode_label, prefill, timed_counts  # noqa: E402

PAIR = ("dynamic", "native")


def rank_main(rank, world, port, args, queue):
    import torch.distributed as dist

    result = {}
    try:
        B.start_rank(rank, world, port, args)
        models, opts, batches = {}, {}, {}
        for name in PAIR:
            models[name], _ = B.BUILDERS[name](args, world)
            opts[name] = B.dense_sgd(models[name], args)
            batches[name] = B.model_batches(name, args, rank)
            prefill(name, models[name], args, rank, world)
            models[name].train()
        times = {name: [] for name in PAIR}
        cpu = {name: [] for name in PAIR}
        counts = [dynamic_counts("dynamic", models["dynamic"])]  # after the pre-fill, before the timed steps, at the end
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                counts.append(dynamic_counts("dynamic", models["dynamic"]))
            for name in (PAIR if i % 2 == 0 else PAIR[::-1]):
                kjt, labels = batches[name][i]
                dist.barrier()
                c, s = time.process_time(), time.perf_counter()
                B.train_step(models[name], opts[name], kjt, labels)
                dt, dc = time.perf_counter() - s, time.process_time() - c
                if i >= args.warmup:
                    times[name].append(dt)
                    cpu[name].append(dc)
        counts.append(dynamic_counts("dynamic", models["dynamic"]))
        dist.barrier()
        result = {"times_s": times, "cpu_times_s": cpu, "counts": timed_counts(counts, batches["dynamic"], args, world)}
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    queue.put((rank, result))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_round(args):
    """{rank: result} of one round on fresh processes."""
    return B.run_ranks(rank_main, args)


def slowest(per_rank, name, key="times_s"):
    """Per step, the slowest rank's time of model `name`."""
    return [max(s) for s in zip(*[per_rank[r][key][name] for r in sorted(per_rank)])]


def quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def ids_line(ids) -> str:
    """What the dynamic tables did in a round's timed steps (id_counts)."""
    lo, hi = ids["load_factor_timed"]
    return (f"{ids['new_ids_timed']} new ids of {ids['unique_ids_timed']} unique, {ids['evicted_timed']} evicting, "
            f"load {lo:.2f} -> {hi:.2f}")


def main(argv=None):
    args = B.parse_args(argv)
    la0 = B.header("torchrec paired", args, f" x {args.rounds} rounds")
    rounds = []
    for rnd in range(args.rounds):
        t0 = time.perf_counter()
        per_rank = run_round(args)
        errors = {r: v["error"] for r, v in per_rank.items() if "error" in v}
        if errors:
            print(f"  round {rnd + 1}: n/a: {errors}")
            for v in per_rank.values():
                if "traceback" in v:
                    print(v["traceback"])
            sys.exit(1)
        steps = {name: slowest(per_rank, name) for name in PAIR}
        cpu = {name: slowest(per_rank, name, "cpu_times_s") for name in PAIR}
        ids = id_counts([per_rank[r]["counts"] for r in sorted(per_rank)], args)
        rounds.append({"step_s": steps, "step_cpu_s": cpu, "ids": ids})
        r = [a / b for a, b in zip(steps["dynamic"], steps["native"])]
        print(f"  round {rnd + 1}: dynamic {statistics.median(steps['dynamic']) * 1e3:.1f} ms, native "
              f"{statistics.median(steps['native']) * 1e3:.1f} ms, per-step ratio median {statistics.median(r):.3f} "
              f"({time.perf_counter() - t0:.0f} s, load {loadavg()}); dynamic tables: {ids_line(ids)}", flush=True)
    pooled = {k: {name: [t for rd in rounds for t in rd[k][name]] for name in PAIR} for k in ("step_s", "step_cpu_s")}
    ratio = [a / b for a, b in zip(pooled["step_s"]["dynamic"], pooled["step_s"]["native"])]
    cpu_ratio = [a / b for a, b in zip(pooled["step_cpu_s"]["dynamic"], pooled["step_cpu_s"]["native"])]
    med = {name: statistics.median(pooled["step_s"][name]) for name in PAIR}
    q1, q2, q3 = quartiles(ratio)
    c1, c2, c3 = quartiles(cpu_ratio)
    per_round = [statistics.median([a / b for a, b in zip(rd["step_s"]["dynamic"], rd["step_s"]["native"])])
                 for rd in rounds]
    print()
    print(format_table(["measure", "dynamic / native", "quartiles"], [
        ["per-step ratio, wall", f"{q2:.3f}", f"{q1:.3f} - {q3:.3f}"],
        ["per-step ratio, CPU time", f"{c2:.3f}", f"{c1:.3f} - {c3:.3f}"],
        ["ratio of median steps", f"{med['dynamic'] / med['native']:.3f}",
         f"{med['dynamic'] * 1e3:.1f} / {med['native'] * 1e3:.1f} ms"],
        ["per-round medians", ", ".join(f"{x:.3f}" for x in per_round), ""],
    ]))
    target = fused_target(args.key_pool, args.new_share)
    print(f"dynamic / native, per-step ratio: {q2:.3f} (target {target}); load average: start {la0}, end {loadavg()}")
    info = env_info(torch.device("cpu"))
    info.update(threads=args.threads, loadavg_start=la0, loadavg_end=loadavg())
    payload = {
        "benchmark": "bench_torchrec_paired",
        "config": {**{k: v for k, v in vars(args).items() if k not in ("models", "out")}, **info},
        "common": {
            "mode": mode_label(args.key_pool, args.new_share, args.rows_per_table),
            "ids": B.ids_mode(args),
            "pairing": "both models in the same ranks; step i of each back to back, dynamic first on even steps; "
                       "a step's time is the slowest rank's, between barriers",
        },
        "results": {"per_step_ratio": {"median": q2, "q1": q1, "q3": q3},
                    "per_step_cpu_ratio": {"median": c2, "q1": c1, "q3": c3},
                    "median_step_s": med, "ratio_of_medians": med["dynamic"] / med["native"],
                    "per_round_median_ratio": per_round, "rounds": rounds},
        "target": target,
    }
    out = args.out if args.out != default_out("bench_torchrec") else default_out(
        "bench_torchrec_paired" + ("_newshare" if args.new_share else ""))
    print(f"wrote {write_json(out, payload)}")


if __name__ == "__main__":
    main()
