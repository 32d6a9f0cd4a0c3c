"""Runs every benchmark with short settings, merges their JSON into
benchmark/results/summary.json and draws benchmark/results/summary.png.

    bash scripts/dev.sh python benchmark/run_all.py                  # all (~9-14 min on 2 CPU cores)
    bash scripts/dev.sh python benchmark/run_all.py --only table,inference
    bash scripts/dev.sh python benchmark/run_all.py --only torchrec_existing,torchrec_newshare,torchrec_evicting  # issue 39's modes
    bash scripts/dev.sh python benchmark/run_all.py --from-json      # redraw from the JSON already there
    bash scripts/dev.sh python benchmark/run_all.py --publish        # ... and copy to docs/

Each script runs in its own process (this interpreter) with the settings in
BENCHMARKS, writing its JSON to a temporary name that replaces
results/<script's JSON> only when the script succeeds; its output goes to
results/logs/<name>.log (and to the terminal). A script that fails or runs
past --timeout is reported and the others still run; the exit status is
nonzero if any failed. A script that does not exist (yet) is skipped with a
note. The summary merges the JSON of this run's benchmarks and, for the ones
not selected by --only, the JSON left by earlier runs (marked "previous",
with the record of the run that wrote it when the summary being replaced has
it: --from-json keeps wall times and exit statuses).

summary.json: {"command", "date", "commit", "git_dirty", "env" (CPU,
threads, versions), "runs" ({name: status, exit code, wall seconds, args}),
"benchmarks" ({name: the script's JSON}), "key_numbers" ({name: headline
numbers, see summary_numbers.py})}. summary.md holds the key numbers as
Markdown tables. --publish copies summary.png, summary.json and summary.md to
docs/benchmark_summary.{png,json,md} (tracked; results/ is git-ignored).
"""
import argparse
import datetime
import importlib.metadata
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _common import env_info, write_json  # noqa: E402
from plot_summary import draw  # noqa: E402
from summary_numbers import KEY_NUMBERS, markdown  # noqa: E402


class Bench(NamedTuple):
    name: str
    script: str  # path, relative to benchmark/ unless absolute
    args: Sequence[str]  # the short settings
    json_name: str  # the file under the results directory (the script's default name, or the mode's)


# Short settings: about 8-13 minutes for all of them on 2 CPU cores. The
# scripts' defaults are the full-size runs (see each script's docstring).
TORCHREC_ARGS = ["--rows-per-table", str(1 << 20), "--batch", "2048", "--steps", "8", "--warmup", "3",
                 "--rounds", "2"]
# The id modes' ratios sit near their targets, and a round's ratio spreads +-10% on 2 cores: 6 alternating
# rounds (about a minute each) instead of 2.
TORCHREC_MODE = ["--models", "dynamic,native", "--rounds", "6"]
TORCHREC_POOL = TORCHREC_MODE + ["--key-pool", str(1 << 18)]
BENCHMARKS: List[Bench] = [
    # The table's targets are set at its full size (16M slots, 1M-key batches; ~40 s): fewer repeats only
    Bench("table", "bench_table.py", ["--repeats", "3"], "bench_table.json"),
    # 1M-id key range: 8 TBE tables of 1M rows (2 GiB) fit beside ours
    Bench("embedding", "bench_embedding.py", ["--key-range", "1000000", "--capacity", str(1 << 18),
                                              "--steps", "8", "--warmup", "3"], "bench_embedding.json"),
    Bench("torchrec", "bench_torchrec.py", TORCHREC_ARGS, "bench_torchrec.json"),
    # Issue 39's id modes, drawn in the torchrec panel, dynamic vs FUSED only: existing ids (a pool of rows / 4
    # keys per table, all stored by a pre-fill before timing), then the same with half of each step's ids never
    # seen before (they take free slots: the pre-fill leaves the tables a third full).
    Bench("torchrec_existing", "bench_torchrec.py", TORCHREC_ARGS + TORCHREC_POOL, "bench_torchrec_existing.json"),
    Bench("torchrec_newshare", "bench_torchrec.py", TORCHREC_ARGS + TORCHREC_POOL + ["--new-share", "0.5"],
          "bench_torchrec_newshare.json"),
    # ... and with a pool as large as the tables, so that the pre-fill fills them and the new ids evict.
    Bench("torchrec_evicting", "bench_torchrec.py",
          TORCHREC_ARGS + TORCHREC_MODE + ["--key-pool", str(1 << 20), "--new-share", "0.5"],
          "bench_torchrec_evicting.json"),
    Bench("tiers", "bench_tiers.py", ["--quick"], "bench_tiers.json"),
    Bench("checkpoint", "bench_checkpoint.py", ["--rows", "2000000"], "bench_checkpoint.json"),
    Bench("inference", "bench_inference.py", ["--repeats", "20"], "inference.json"),
    # ~1 min: 600 steps of growth, eviction, flushes, evals and dumps; RSS, fds and threads stay flat
    Bench("soak", "soak.py", ["--steps", "600", "--warmup", "150", "--every", "20"], "soak.json"),
    # Model quality at equal memory (progressive validation, 6 setups x 2 budgets x 3 seeds): ~2-3 min
    Bench("quality", "bench_quality.py", ["--quick"], "bench_quality.json"),
]
NAMES = [b.name for b in BENCHMARKS]
PUBLISH_DIR = os.path.join(ROOT, "docs")
PUBLISH_STEM = "benchmark_summary"


# ---- running ---------------------------------------------------------------------------------


def _show(path: str) -> str:
    """A path for the records: relative to the repository when inside it."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    return path if rel.startswith("..") else rel


def _script_path(b: Bench) -> str:
    return b.script if os.path.isabs(b.script) else os.path.join(HERE, b.script)


def _pump(stream, log, echo: bool) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


def run_one(b: Bench, results_dir: str, timeout: float, echo: bool = True) -> Dict[str, Any]:
    """Runs one script in its own process group; its JSON replaces
    results_dir/<json_name> only if it exits 0 and wrote valid JSON."""
    script = _script_path(b)
    rec: Dict[str, Any] = {"script": _show(script), "args": list(b.args)}
    if not os.path.exists(script):
        rec.update(status="skipped", note=f"{rec['script']} does not exist (yet)")
        return rec
    out = os.path.join(results_dir, b.json_name)
    tmp = out + ".tmp"
    logs = os.path.join(results_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    log_path = os.path.join(logs, f"{b.name}.log")
    rec["log"] = _show(log_path)
    cmd = [sys.executable, script, *b.args, "--out", tmp]
    if os.path.exists(tmp):
        os.remove(tmp)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        # Its own session: a timeout ends the script and the ranks it spawned, nothing else.
        p = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        pump = threading.Thread(target=_pump, args=(p.stdout, log, echo), daemon=True)
        pump.start()
        timed_out = False
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:  # Ctrl-C: the script's session does not get the terminal's signal
            os.killpg(p.pid, signal.SIGKILL)
            raise
        if timed_out:
            os.killpg(p.pid, signal.SIGKILL)
            rc = p.wait()
        pump.join(timeout=10)
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    rec["exit_code"] = rc
    if timed_out:
        rec.update(status="failed", note=f"timed out after {timeout:g} s")
    elif rc != 0:
        rec.update(status="failed", note=f"exit code {rc}; see {rec['log']}")
    else:
        try:
            with open(tmp) as f:
                json.load(f)
            os.replace(tmp, out)
            rec["status"] = "ok"
        except (OSError, ValueError) as e:
            rec.update(status="failed", note=f"exit code 0 but no valid JSON at --out: {e}")
    if os.path.exists(tmp):
        os.remove(tmp)
    return rec


# ---- merging ---------------------------------------------------------------------------------


def _git(*args: str) -> Optional[str]:
    try:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def env() -> Dict[str, Any]:
    """The machine and versions (benchmark/_common.env_info plus the libraries compared against)."""
    info = env_info(torch.device("cpu"))
    for k in ("git_commit", "date", "loadavg_start"):  # per benchmark in its own JSON; the summary has its own
        info.pop(k, None)
    for pkg in ("torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu", "numpy", "matplotlib"):
        try:
            info[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


def measured(data: dict) -> Dict[str, Any]:
    """Where and when a script's JSON was measured (its env_info fields)."""
    e = data.get("config") if "git_commit" in data.get("config", {}) else data.get("env", {})
    return {k: e[k] for k in ("git_commit", "date", "loadavg_start", "threads") if e.get(k) is not None}


def _earlier_runs(results_dir: str) -> Dict[str, Dict[str, Any]]:
    """The run records of the summary already in results_dir (none if there is none or it is unreadable)."""
    try:
        with open(os.path.join(results_dir, "summary.json")) as f:
            prev = json.load(f)
    except (OSError, ValueError):
        return {}
    runs = prev.get("runs", {})
    for rec in runs.values():
        if rec.get("status") == "ok":
            rec.setdefault("command", prev.get("command"))
    return runs


def merge(results_dir: str, benchmarks: Sequence[Bench], runs: Dict[str, Dict[str, Any]],
          command: str) -> Dict[str, Any]:
    """The summary: this run's records, every benchmark's JSON that is valid
    for it (this run's, or an earlier run's for benchmarks not run now) and
    their key numbers."""
    merged, key, errors = {}, {}, {}
    earlier = _earlier_runs(results_dir)
    for b in benchmarks:
        rec = runs.setdefault(b.name, {"status": "not run"})
        path = os.path.join(results_dir, b.json_name)
        if rec["status"] in ("failed", "skipped") or not os.path.exists(path):
            if rec["status"] == "not run":
                rec["status"] = "missing"
                rec["note"] = f"no {_show(path)}"
            continue
        with open(path) as f:
            data = json.load(f)
        rec["json"] = _show(path)
        rec["measured"] = measured(data)
        if rec["status"] == "not run":
            rec["status"] = "previous"  # an earlier run's JSON
            # The record of the run that wrote it (wall time, exit status, arguments), from the last summary.
            prev = earlier.get(b.name, {})
            prev_run = prev.get("previous_run") if prev.get("status") == "previous" else prev
            if prev.get("measured") == rec["measured"] and prev_run:
                rec["previous_run"] = {k: prev_run[k] for k in ("args", "wall_s", "exit_code", "log", "command")
                                       if k in prev_run}
        merged[b.name] = data
        try:
            key[b.name] = KEY_NUMBERS[b.name](data)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            errors[b.name] = f"{type(e).__name__}: {e}"
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    out = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "git_dirty": bool(dirty) if dirty is not None else None,
        "env": env(),
        "runs": runs,
        "benchmarks": merged,
        "key_numbers": key,
    }
    if errors:
        out["key_number_errors"] = errors
    return out


def publish(results_dir: str, dest_dir: str = PUBLISH_DIR) -> List[str]:
    os.makedirs(dest_dir, exist_ok=True)
    done = []
    for ext in ("png", "json", "md"):
        src = os.path.join(results_dir, f"summary.{ext}")
        dst = os.path.join(dest_dir, f"{PUBLISH_STEM}.{ext}")
        shutil.copyfile(src, dst)
        done.append(dst)
    return done


# ---- main ------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None, benchmarks: Sequence[Bench] = BENCHMARKS) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [b.name for b in benchmarks]
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(names)}")
    ap.add_argument("--from-json", action="store_true",
                    help="run nothing: merge the JSON already in the results directory and redraw")
    ap.add_argument("--results-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before a script is given up")
    ap.add_argument("--publish", action="store_true",
                    help=f"copy summary.png/.json/.md to docs/{PUBLISH_STEM}.* (tracked, for the README)")
    ap.add_argument("--quiet", action="store_true", help="the scripts' output only to their logs")
    args = ap.parse_args(argv)
    selected = names
    if args.only:
        selected = [n.strip() for n in args.only.split(",") if n.strip()]
        bad = [n for n in selected if n not in names]
        if bad:
            ap.error(f"--only: unknown benchmark(s) {bad}; choose among {names}")
    command = " ".join(shlex.quote(a) for a in ["python", _show(sys.argv[0])]
                       + list(sys.argv[1:] if argv is None else argv))
    results_dir = os.path.abspath(args.results_dir)
    os.makedirs(results_dir, exist_ok=True)

    runs: Dict[str, Dict[str, Any]] = {}
    if not args.from_json:
        t_all = time.perf_counter()
        for b in benchmarks:
            if b.name not in selected:
                continue
            print(f"[run_all] {b.name}: {b.script} {' '.join(b.args)}", flush=True)
            runs[b.name] = rec = run_one(b, results_dir, args.timeout, echo=not args.quiet)
            print(f"[run_all] {b.name}: {rec['status']}"
                  + (f" in {rec['wall_s']:.0f} s" if "wall_s" in rec else "")
                  + (f" ({rec['note']})" if "note" in rec else ""), flush=True)
        print(f"[run_all] all ran in {time.perf_counter() - t_all:.0f} s", flush=True)

    summary = merge(results_dir, benchmarks, runs, command)
    write_json(os.path.join(results_dir, "summary.json"), summary)
    with open(os.path.join(results_dir, "summary.md"), "w") as f:
        f.write(markdown(summary["key_numbers"]))
    panels = draw(summary, os.path.join(results_dir, "summary.png"))

    print()
    for name, rec in summary["runs"].items():
        wall_s = rec.get("wall_s", rec.get("previous_run", {}).get("wall_s"))
        wall = f"{wall_s:6.0f} s" if wall_s is not None else " " * 8
        print(f"  {name:<17} {rec['status']:<9} {wall}  {rec.get('note', '')}")
    print(f"wrote {_show(os.path.join(results_dir, 'summary.json'))}, summary.md and "
          f"summary.png ({len(panels)} panels: {', '.join(panels)})")
    for e in summary.get("key_number_errors", {}).items():
        print(f"  key numbers of {e[0]} not read: {e[1]}")
    if args.publish:
        for p in publish(results_dir):
            print(f"published {_show(p)}")
    failed = [n for n, r in runs.items() if r["status"] == "failed"]
    if failed:
        print(f"[run_all] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or summary.get("key_number_errors") else 0


if __name__ == "__main__":
    sys.exit(main())
