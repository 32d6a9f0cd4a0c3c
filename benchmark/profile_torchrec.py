"""Where a DMP training step's time goes: bench_torchrec's dynamic model
against TorchRec's FUSED tables, phase by phase and op by op.

    bash scripts/dev.sh python benchmark/profile_torchrec.py [--rows-per-table 1048576] [--batch 2048]
    bash scripts/dev.sh python benchmark/profile_torchrec.py --new-share 0.5   # half the ids new each step
    bash scripts/dev.sh python benchmark/profile_torchrec.py --key-pool 262144  # existing ids (pre-filled)

Same models, ids and settings as bench_torchrec.py (its builders and
batches; with --key-pool the same pre-fill before the steps). Every rank times each step's phases between barriers; a phase's
time is the slowest rank's, the result the median over --steps steps:

  input dist      the sharded EBC's input_dist and its two waits (routing,
                  the KJT splits and values all-to-all, the permutes)
  lookup          the lookup modules' forward (unique, hash lookup/insert,
                  gather + pool; for FUSED: the TBE forward)
  output dist     the rest of compute_and_output_dist plus the wait of its
                  output (the pooled embeddings' all-to-all), and the dense
                  forward and loss (a Linear: tiny)
  backward        loss.backward(): the gradients' all-to-all back, the
                  embedding backward and the fused table update
  optimizer       the dense SGD step and zero_grad
  rest            the step minus the phases (the DMP wrapper, Python glue)

On rank 0 the last --profile-steps steps also run under torch.profiler: the
ops with the most self CPU time of each model are printed and written to
the JSON (results/profile_torchrec.json), with a Chrome trace per model when
--trace DIR is given.
"""
import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_torchrec as B  # noqa: E402
import torchrec_batches as ids  # noqa: E402
from _common import default_out, env_info, format_table, write_json  # noqa: E402

PHASES = ("input dist", "lookup", "output dist", "backward", "optimizer", "rest", "step")


class PhaseClock:
    """Accumulates the wall time of named phases within one step."""

    def __init__(self):
        self.t = {}

    @contextmanager
    def phase(self, name):
        s = time.perf_counter()
        try:
            with torch.profiler.record_function(f"## phase: {name} ##"):
                yield
        finally:
            self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - s


def instrument(model, clock: PhaseClock) -> None:
    """Times the sharded EBC's input dist, its lookups, and its compute and
    output dist, by wrapping them on the instances of this model."""
    from torchrec.distributed.types import ShardedModule

    sharded = [m for m in model.modules() if isinstance(m, ShardedModule)]
    if len(sharded) != 1:
        raise RuntimeError(f"expected one sharded module, found {len(sharded)}")
    ebc = sharded[0]
    input_dist, compute_out = ebc.input_dist, ebc.compute_and_output_dist

    def timed_input_dist(ctx, *args, **kwargs):
        with clock.phase("input dist"):
            return Done(input_dist(ctx, *args, **kwargs).wait().wait())

    def timed_compute_out(ctx, dist_input):
        with clock.phase("compute+output dist"):
            return compute_out(ctx, dist_input)
    ebc.input_dist, ebc.compute_and_output_dist = timed_input_dist, timed_compute_out
    for lookup in ebc._lookups:
        fwd = lookup.forward

        def timed_lookup(*args, _fwd=fwd, **kwargs):
            with clock.phase("lookup"):
                return _fwd(*args, **kwargs)
        lookup.forward = timed_lookup


class Done:
    """An awaitable of an awaitable of a value already there (the timed input dist waited)."""

    def __init__(self, value, depth=2):
        self.value, self.depth = value, depth

    def wait(self):
        return Done(self.value, self.depth - 1) if self.depth > 1 else self.value


def rank_main(name, rank, world, port, args, queue):
    import torch.distributed as dist

    result = {}
    try:
        B.start_rank(rank, world, port, args)
        model, _ = B.BUILDERS[name](args, world)
        batches = B.model_batches(name, args, rank)
        opt = B.dense_sgd(model, args)
        result["prefill_s"] = ids.prefill(name, model, args, rank, world)  # before the phases are wrapped
        clock = PhaseClock()
        instrument(model, clock)
        model.train()
        per_step = []
        prof = None
        first_profiled = len(batches) - args.profile_steps
        for i, (kjt, labels) in enumerate(batches):
            if rank == 0 and i == first_profiled and args.profile_steps > 0:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False)
                prof.__enter__()
            dist.barrier()
            clock.t = {}
            s = time.perf_counter()
            fwd_start = time.perf_counter()
            loss = model(kjt, labels)
            fwd = time.perf_counter() - fwd_start
            with clock.phase("backward"):
                loss.backward()
            with clock.phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            step = time.perf_counter() - s
            t = dict(clock.t)
            co = t.pop("compute+output dist", 0.0)
            # Output dist: compute_and_output_dist without the lookups, plus the forward's
            # remainder after it (the output's wait, dense forward, loss).
            t["output dist"] = co - t.get("lookup", 0.0) + (fwd - t.get("input dist", 0.0) - co)
            t["step"] = step
            t["rest"] = step - fwd - t["backward"] - t["optimizer"]
            if i >= args.warmup:
                per_step.append(t)
        if prof is not None:
            prof.__exit__(None, None, None)
            if args.trace:
                os.makedirs(args.trace, exist_ok=True)
                prof.export_chrome_trace(os.path.join(args.trace, f"{name}.json"))
            ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            result["top_ops"] = [{"op": e.key, "calls_per_step": e.count / args.profile_steps,
                                  "self_ms_per_step": e.self_cpu_time_total / 1e3 / args.profile_steps,
                                  "total_ms_per_step": e.cpu_time_total / 1e3 / args.profile_steps}
                                 for e in ops[:args.top]]
        result["phases"] = per_step
        dist.barrier()
    except Exception as e:  # noqa: BLE001 - reported by the parent
        import traceback
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    queue.put((rank, result))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def by_rank(per_rank):
    """{rank: {phase: that rank's median ms}}: a rank that is slower in every step shows here."""
    return {r: {p: 1e3 * statistics.median(s.get(p, 0.0) for s in per_rank[r]["phases"]) for p in PHASES}
            for r in sorted(per_rank)}


def summarize(per_rank):
    """{phase: median over steps of the slowest rank's ms}."""
    steps = list(zip(*[per_rank[r]["phases"] for r in sorted(per_rank)]))
    return {p: 1e3 * statistics.median(max(s[r].get(p, 0.0) for r in range(len(s))) for s in steps)
            for p in PHASES}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rows-per-table", type=int, default=1 << 20)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--pooling", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--new-share", type=float, default=0.0, help="share of each step's ids never seen before")
    ap.add_argument("--key-pool", type=int, default=0,
                    help="existing ids: each table's ids from N keys, pre-filled before the steps (as bench_torchrec)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=3, help="last steps profiled on rank 0 (0: none)")
    ap.add_argument("--top", type=int, default=25, help="ops listed per model")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="dynamic,native")
    ap.add_argument("--trace", default=None, help="directory for Chrome traces")
    ap.add_argument("--out", default=default_out("profile_torchrec"))
    args = ap.parse_args(argv)
    args.threads = args.threads or max(1, (os.cpu_count() or 2) // args.world)
    why = ids.check_key_pool(args, args.world)
    if why:
        ap.error(why)
    # bench_torchrec's builders read these
    args.dynamic_init, args.mc_policy, args.mc_eviction_interval = "uniform", "lru", 1
    args.collective_timeout, args.model_timeout = 300.0, 1800.0
    B.rank_main = rank_main  # run_model spawns B.rank_main
    models = args.models.split(",")
    print(f"[profile_torchrec] {args.tables} tables x dim {args.dim}, {args.rows_per_table} rows per table, "
          f"{args.world} ranks, batch {args.batch}/rank x pooling {args.pooling}\n  ids: {B.ids_mode(args)}",
          flush=True)
    res = {}
    for name in models:
        per_rank = B.run_model(name, args)
        errors = {r: v["error"] for r, v in per_rank.items() if "error" in v}
        if errors:
            res[name] = {"error": errors, "traceback": per_rank[min(errors)].get("traceback")}
            print(f"{name}: failed: {errors}\n{res[name]['traceback']}")
            continue
        res[name] = {"phases_ms": summarize(per_rank), "phases_ms_by_rank": by_rank(per_rank),
                     "steps_ms_by_rank": {r: [{k: 1e3 * v for k, v in t.items()} for t in per_rank[r]["phases"]]
                                          for r in sorted(per_rank)},
                     "top_ops": per_rank[0].get("top_ops", []),
                     "prefill_s": max(v["prefill_s"] for v in per_rank.values())}
    ok = [m for m in models if "phases_ms" in res.get(m, {})]
    rows = [[p] + [f"{res[m]['phases_ms'][p]:.1f}" for m in ok] for p in PHASES]
    if "dynamic" in ok and "native" in ok:
        for r, p in zip(rows, PHASES):
            n = res["native"]["phases_ms"][p]
            r.append(f"{res['dynamic']['phases_ms'][p] / n:.2f}" if n > 0.05 else "-")
    print(format_table(["phase (ms, slowest rank, median)"] + ok + (["dynamic / native"] if len(ok) == 2 else []),
                       rows))
    for m in ok:
        ranks = res[m]["phases_ms_by_rank"]
        print(f"\n{m}: each rank's median ms: " + "; ".join(
            f"rank {r}: " + ", ".join(f"{p} {v[p]:.1f}" for p in ("lookup", "output dist", "backward", "step"))
            for r, v in ranks.items()))
    for m in ok:
        print(f"\n{m}: top ops by self CPU time on rank 0 (ms per step)")
        print(format_table(["op", "calls", "self ms", "total ms"],
                           [[o["op"][:70], f"{o['calls_per_step']:.0f}", f"{o['self_ms_per_step']:.2f}",
                             f"{o['total_ms_per_step']:.2f}"] for o in res[m]["top_ops"]]))
    out = {"benchmark": "profile_torchrec", "config": {**vars(args), **env_info(torch.device("cpu"))},
           "ids": B.ids_mode(args), "results": res}
    if args.out:
        write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
