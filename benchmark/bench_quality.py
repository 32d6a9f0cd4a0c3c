"""Does it pay? Model quality at equal memory: progressive validation of the
example's DLRM with dynamic tables against hashed static tables and TorchRec's
managed collisions.

    bash scripts/dev.sh bench quality                  # default settings (~20 min on 2 shared cores, 1 thread)
    bash scripts/dev.sh bench quality --quick          # about 2 minutes (run_all.py)
    bash scripts/dev.sh bench quality --data movielens PATH
    bash scripts/dev.sh bench quality --setups fold,lru --seeds 0 --budgets 1/16

The stream: the example's generated click log (example_data/synthetic.py:
Zipf ids over 2**40, fresh ids every period of 32768 samples, labels from a
hidden model), or --data criteo|movielens PATH through the example's readers,
cut into --windows windows of --window-batches batches. Progressive
validation: each window is first scored (the model in eval mode, nothing
inserted, nothing trained), then trained on, batch by batch; a window's AUC
and log loss are those of its scores. Every setup of one seed gets the same
batches (checked: a digest of every batch it scored and trained on).

The model: the example's DLRM (dense arch [64, dim], over arch [128, 64, 1],
Adam 1e-3 on the dense part) over the embedding setups of quality_setups.py,
each table trained by EXACT_ROWWISE_ADAGRAD (lr 0.05). The row budget of a
large-vocabulary table is a fraction (--budgets) of the distinct ids the
stream holds for it, in whole buckets of 128 rows, the same for every setup;
`unlimited` has room for all of them.

Reported per (setup, budget): the AUC and log loss of every window (mean and
spread over --seeds), the final AUC / log loss (pooled over the last quarter
of the windows), the median training step (forward + backward + optimizer),
the rows held at the end, and each budgeted setup's paired AUC gap to `fold`
(per seed, same data), and the share of the scored ids that found a row of
their own (not for fold: every id reads a row it shares). The JSON goes to --out (benchmark/results/bench_quality.json).
"""
import argparse
import hashlib
import math
import os
import statistics
import sys
import time
from fractions import Fraction
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # the example's data readers
from _common import busy_warning, default_out, env_info, format_table, write_json  # noqa: E402
from example_data import NUM_DENSE, SPARSE_FEATURES, ClickRows  # noqa: E402
from quality_setups import BUDGETED, FEATURES, LARGE, SETUPS, Embeddings, budget_rows  # noqa: E402

DEFAULTS = dict(windows=30, window_batches=25, batch_size=512)
QUICK = dict(windows=10, window_batches=8, batch_size=512)
FINAL_SHARE = 0.25  # the final numbers pool the last quarter of the windows


# ---- the stream -----------------------------------------------------------------------------------


class Stream(NamedTuple):
    """windows[w][b]: (dense, kjt with keys FEATURES, labels); distinct[t]:
    distinct ids of LARGE table t over the whole stream; digest: of every batch."""
    windows: List[List[tuple]]
    distinct: List[int]
    digest: str


def batch_digest(batch: tuple, h=None):
    """A sha1 over a batch's dense features, ids, lengths and labels (updates `h` if given)."""
    h = h or hashlib.sha1()
    dense, kjt, labels = batch
    for t in (dense, kjt.values(), kjt.lengths(), labels):
        h.update(t.contiguous().numpy().tobytes())
    return h


def to_batch(rows: ClickRows) -> tuple:
    """(dense, KeyedJaggedTensor of FEATURES, feature-major, a missing feature an empty bag, labels)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    cols = [SPARSE_FEATURES.index(f) for f in FEATURES]
    present, ids = rows.present[:, cols].t(), rows.ids[:, cols].t()
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=ids[present],
                                              lengths=present.reshape(-1).to(torch.int64))
    return rows.dense, kjt, rows.labels


def make_stream(kind: str, path: Optional[str], seed: int, windows: int, window_batches: int, batch_size: int,
                max_rows: Optional[int] = None) -> Stream:
    """The first windows * window_batches * batch_size samples of the log (the
    generated one of `seed`, or a file's, read in order, in epochs if short)."""
    from example_data import open_log
    n = windows * window_batches * batch_size
    log = open_log(kind, path, n, 0, seed=seed, max_rows=max_rows, eval_fraction=0.01)  # a file's last 1% unused
    rows = log.train(0, n)
    large = [SPARSE_FEATURES.index(f) for f in LARGE]
    distinct = [int(torch.unique(rows.ids[:, j][rows.present[:, j]]).numel()) for j in large]
    out, h = [], hashlib.sha1()
    for w in range(windows):
        win = []
        for b in range(window_batches):
            start = (w * window_batches + b) * batch_size
            batch = to_batch(rows.take(torch.arange(start, start + batch_size)))
            batch_digest(batch, h)
            win.append(batch)
        out.append(win)
    return Stream(out, distinct, h.hexdigest())


# ---- metrics and the progressive-validation loop ----------------------------------------------------


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC (Mann-Whitney U; tied scores share their average rank); nan with one class only."""
    scores, labels = scores.double().flatten(), labels.flatten() > 0.5
    pos, n = int(labels.sum()), labels.numel()
    if pos == 0 or pos == n:
        return float("nan")
    order = torch.argsort(scores)
    sorted_s = scores[order]
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = torch.arange(1, n + 1, dtype=torch.float64)
    # Ties: every member of a run of equal scores gets the run's mean rank.
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts + 1
    mean_rank = (first + (counts - 1) / 2.0).double()
    ranks[order] = mean_rank[inverse]
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * (n - pos)))


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float(torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double()))


def progressive_validation(windows: Sequence[Sequence[tuple]], score: Callable[[tuple], torch.Tensor],
                           train: Callable[[tuple], float], after_window: Optional[Callable[[], dict]] = None,
                           digest=None) -> List[dict]:
    """Per window: score(batch) -> logits for each of its batches, then
    train(batch) -> seconds for each; records the window's AUC and log loss
    (of its scores), its median train seconds and after_window()'s dict.
    `digest` (a hashlib object), if given, takes every batch as it is scored."""
    records = []
    for w, batches in enumerate(windows):
        logits, labels = [], []
        for batch in batches:
            if digest is not None:
                batch_digest(batch, digest)
            logits.append(score(batch).detach().flatten())
            labels.append(batch[2])
        logits, labels = torch.cat(logits), torch.cat(labels)
        seconds = [train(batch) for batch in batches]
        rec = {"window": w, "samples": labels.numel(), "auc": auc(logits, labels), "log_loss": log_loss(logits, labels),
               "step_ms": 1e3 * statistics.median(seconds), "logits": logits, "labels": labels}
        if after_window is not None:
            rec.update(after_window())
        records.append(rec)
    return records


# ---- one run ----------------------------------------------------------------------------------------


def build_model(setup: str, rows: Sequence[int], dim: int, seed: int):
    """DLRM over the setup's tables; the dense part's initial weights depend on `seed` only."""
    from torchrec.models.dlrm import DLRM
    tables = Embeddings(setup, rows, dim, seed)
    torch.manual_seed(seed)  # after the tables: the same dense start for every setup
    model = DLRM(embedding_bag_collection=tables, dense_in_features=NUM_DENSE, dense_arch_layer_sizes=[64, dim],
                 over_arch_layer_sizes=[128, 64, 1])
    dense = [p for part in (model.dense_arch, model.inter_arch, model.over_arch) for p in part.parameters()]
    return model, torch.optim.Adam(dense, lr=1e-3)


def run_setup(setup: str, rows: Sequence[int], stream: Stream, seed: int, dim: int) -> dict:
    model, opt = build_model(setup, rows, dim, seed)
    tables = model.sparse_arch.embedding_bag_collection

    held = [0, 0]  # ids of the window's scored batches with a row of their own, ids

    def score(batch):
        model.eval()
        with torch.no_grad():
            mine = tables.held(batch[1])
            if mine is not None:
                held[0] += int(mine.sum())
                held[1] += mine.numel()
            return model(batch[0], batch[1]).squeeze(1)

    def after_window():
        # The share of the window's ids that found a row of their own when it was scored.
        share = held[0] / held[1] if held[1] else None
        held[0] = held[1] = 0
        return {**tables.stats(), "held_share": share}

    def train(batch):
        model.train()
        t0 = time.perf_counter()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch[0], batch[1]).squeeze(1), batch[2])
        opt.zero_grad()
        loss.backward()  # the tables update themselves here
        opt.step()
        return time.perf_counter() - t0

    h = hashlib.sha1()
    t0 = time.perf_counter()
    recs = progressive_validation(stream.windows, score, train, after_window, h)
    wall = time.perf_counter() - t0
    k = max(1, math.ceil(FINAL_SHARE * len(recs)))
    tail_logits = torch.cat([r.pop("logits") for r in recs[-k:]])
    tail_labels = torch.cat([r.pop("labels") for r in recs[-k:]])
    for r in recs[:-k]:
        del r["logits"], r["labels"]
    steps = [r["step_ms"] for r in recs]
    return {"setup": setup, "seed": seed, "rows_per_table": list(rows), "rows_budget": int(sum(rows)),
            "digest": h.hexdigest(), "windows": recs, "final_auc": auc(tail_logits, tail_labels),
            "final_log_loss": log_loss(tail_logits, tail_labels), "final_windows": k,
            "step_ms": statistics.median(steps), "wall_s": wall, **tables.stats(),
            "final_held_share": _tail_mean([r["held_share"] for r in recs[-k:]])}


def _tail_mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


# ---- the summary ------------------------------------------------------------------------------------


def _mean_spread(xs: Sequence[float]) -> dict:
    """mean and spread (sample standard deviation; 0 for one value) of xs."""
    xs = [x for x in xs if not math.isnan(x)]
    return {"mean": statistics.fmean(xs) if xs else float("nan"),
            "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def summarize(runs: List[dict]) -> Dict[str, dict]:
    """Per group "setup@budget" (`unlimited` alone): means and spreads over seeds."""
    groups: Dict[str, List[dict]] = {}
    for r in runs:
        groups.setdefault(r["group"], []).append(r)
    fold = {(r["budget"], r["seed"]): r for r in runs if r["setup"] == "fold"}
    out = {}
    for g, rs in groups.items():
        n_win = min(len(r["windows"]) for r in rs)
        s = {"setup": rs[0]["setup"], "budget": rs[0]["budget"], "label": SETUPS[rs[0]["setup"]],
             "seeds": [r["seed"] for r in rs],
             "final_auc": _mean_spread([r["final_auc"] for r in rs]),
             "final_log_loss": _mean_spread([r["final_log_loss"] for r in rs]),
             "step_ms": _mean_spread([r["step_ms"] for r in rs]),
             "rows_held": _mean_spread([r["rows_held"] for r in rs]),
             "rows_budget": _mean_spread([r["rows_budget"] for r in rs]),
             "failed_inserts": _mean_spread([r.get("failed", 0) for r in rs]),
             "final_held_share": (_mean_spread([r["final_held_share"] for r in rs])
                                  if all(r.get("final_held_share") is not None for r in rs) else None),
             "auc_by_window": [_mean_spread([r["windows"][w]["auc"] for r in rs]) for w in range(n_win)],
             "log_loss_by_window": [_mean_spread([r["windows"][w]["log_loss"] for r in rs]) for w in range(n_win)]}
        pairs = [(r, fold.get((r["budget"], r["seed"]))) for r in rs]
        if all(f is not None for _, f in pairs) and s["setup"] != "fold":
            s["auc_gap_vs_fold"] = _mean_spread([r["final_auc"] - f["final_auc"] for r, f in pairs])
            s["log_loss_gap_vs_fold"] = _mean_spread([r["final_log_loss"] - f["final_log_loss"] for r, f in pairs])
        out[g] = s
    return out


def results_table(summary: Dict[str, dict]) -> str:
    rows = []
    for g, s in summary.items():
        gap = s.get("auc_gap_vs_fold")
        rows.append([s["label"], "all ids" if s["budget"] is None else f"1/{round(1 / s['budget'])}",
                     f"{s['rows_held']['mean']:,.0f} / {s['rows_budget']['mean']:,.0f}",
                     f"{s['final_auc']['mean']:.4f} ± {s['final_auc']['std']:.4f}",
                     f"{s['final_log_loss']['mean']:.4f} ± {s['final_log_loss']['std']:.4f}",
                     "-" if gap is None else f"{gap['mean']:+.4f} ± {gap['std']:.4f}",
                     "-" if s.get("final_held_share") is None else f"{s['final_held_share']['mean']:.1%}",
                     f"{s['step_ms']['mean']:.1f}"])
    return format_table(["setup", "budget", "rows held / budget", "final AUC", "final log loss",
                         "AUC - fold (paired)", "ids with a row", "step ms"], rows)


# ---- main -------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", default=["generated"], metavar=("KIND", "PATH"),
                    help="generated (default), criteo PATH or movielens PATH")
    ap.add_argument("--max-rows", type=int, default=None, help="rows to read from a file")
    ap.add_argument("--quick", action="store_true", help=f"shorter stream: {QUICK}")
    ap.add_argument("--windows", type=int, default=None, help=f"default {DEFAULTS['windows']}")
    ap.add_argument("--window-batches", type=int, default=None, help=f"default {DEFAULTS['window_batches']}")
    ap.add_argument("--batch-size", type=int, default=None, help=f"default {DEFAULTS['batch_size']}")
    ap.add_argument("--budgets", default="1/16,1/4", help="row budgets: fractions of the distinct ids per table")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated subset of {','.join(SETUPS)}")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine, 2 threads spin-wait on each other)")
    ap.add_argument("--out", default=default_out("bench_quality"))
    a = ap.parse_args(argv)
    base = QUICK if a.quick else DEFAULTS
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.kind, a.path = a.data[0], (a.data[1] if len(a.data) > 1 else None)
    if a.kind not in ("generated", "criteo", "movielens") or len(a.data) != (1 if a.kind == "generated" else 2):
        ap.error("--data takes 'generated', 'criteo PATH' or 'movielens PATH'")
    try:
        a.budget_list = [float(Fraction(b.strip())) for b in a.budgets.split(",")]  # "1/16" -> 0.0625
    except (ValueError, ZeroDivisionError):
        ap.error(f"--budgets: fractions such as 1/16,0.25, got {a.budgets!r}")
    if not all(0 < b <= 1 for b in a.budget_list):
        ap.error(f"--budgets must be in (0, 1], got {a.budgets!r}")
    a.seed_list = [int(s) for s in a.seeds.split(",")]
    a.setup_list = [s.strip() for s in a.setups.split(",") if s.strip()]
    bad = [s for s in a.setup_list if s not in SETUPS]
    if bad:
        ap.error(f"--setups: unknown {bad}; choose among {list(SETUPS)}")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    try:
        return _run(a)
    finally:
        torch.set_num_threads(threads)  # as it was for the caller (tests call main in-process)


def _run(a) -> dict:
    env = env_info(torch.device("cpu"))  # the commit, date and load average at the start
    warn = busy_warning(torch.get_num_threads())
    if warn:
        print(warn)
    runs, streams = [], {}
    t_all = time.perf_counter()
    for seed in a.seed_list:
        t0 = time.perf_counter()
        stream = make_stream(a.kind, a.path, seed, a.windows, a.window_batches, a.batch_size, a.max_rows)
        streams[seed] = {"digest": stream.digest, "distinct_ids": stream.distinct}
        print(f"[stream] seed {seed}: {a.windows} windows x {a.window_batches} batches x {a.batch_size} samples, "
              f"{sum(stream.distinct):,} distinct ids in {len(LARGE)} large tables ({time.perf_counter() - t0:.1f} s)",
              flush=True)
        plan = [(s, b) for b in a.budget_list for s in a.setup_list if s in BUDGETED]
        if "unlimited" in a.setup_list:
            plan.append(("unlimited", None))
        for setup, budget in plan:
            rows = budget_rows(stream.distinct, budget)
            r = run_setup(setup, rows, stream, seed, a.dim)
            if r["digest"] != stream.digest:
                raise SystemExit(f"{setup}: the batches it saw differ from the stream's (digest)")
            r["budget"] = budget
            r["group"] = setup if budget is None else f"{setup}@{budget:g}"
            runs.append(r)
            print(f"  {r['group']:<18} seed {seed}: final AUC {r['final_auc']:.4f}, log loss "
                  f"{r['final_log_loss']:.4f}, step {r['step_ms']:.1f} ms, rows {r['rows_held']:,} / "
                  f"{r['rows_budget']:,}, {r['wall_s']:.0f} s", flush=True)
    summary = summarize(runs)
    print()
    print(results_table(summary))
    wall_by_setup: Dict[str, float] = {}
    for r in runs:
        wall_by_setup[r["setup"]] = wall_by_setup.get(r["setup"], 0.0) + r["wall_s"]
    out = {"benchmark": "bench_quality",
           "config": {**env, "data": a.kind, "path": a.path, "windows": a.windows,
                      "window_batches": a.window_batches, "batch_size": a.batch_size, "budgets": a.budget_list,
                      "seeds": a.seed_list, "setups": a.setup_list, "dim": a.dim, "quick": a.quick,
                      "final_share": FINAL_SHARE, "setup_labels": SETUPS,
                      "spread": "sample standard deviation over seeds",
                      "optimizer": "tables EXACT_ROWWISE_ADAGRAD lr 0.05; dense Adam lr 1e-3"},
           "streams": {str(k): v for k, v in streams.items()},
           "summary": summary, "wall_s_by_setup": wall_by_setup, "wall_s": time.perf_counter() - t_all,
           "runs": runs}
    write_json(a.out, out)
    print("\nwall seconds per setup (all budgets and seeds): "
          + ", ".join(f"{k} {v:.0f}" for k, v in wall_by_setup.items()) + f"; wrote {a.out}")
    return out


if __name__ == "__main__":
    main()
