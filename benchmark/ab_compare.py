"""A/B: the same benchmarks on two checkouts (each with its extension built
in place), run in alternation so that both sides see the same machine load;
prints each headline number's median per side and new / base, and writes
JSON. Use it to show that a change leaves speed unchanged:

    git worktree add /tmp/base c62d749 && (cd /tmp/base && python setup.py -q build_ext --inplace)
    python benchmark/ab_compare.py --base /tmp/base --new . --rounds 3

Settings are small (each run well under a minute); the JSON records them.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from summary_numbers import KEY_NUMBERS  # noqa: E402

# name -> (script arguments, headline numbers from summary_numbers' key dict; lower is better unless "rate")
SETTINGS = {
    "table": ["--slots", str(1 << 22), "--batch", str(1 << 19), "--load-factors", "0.5", "--repeats", "3"],
    "embedding": ["--key-range", "1000000", "--capacity", str(1 << 18), "--steps", "6", "--warmup", "2"],
    "torchrec": ["--rows-per-table", str(1 << 18), "--batch", "1024", "--steps", "6", "--warmup", "2",
                 "--rounds", "1", "--models", "dynamic"],
    "tiers": ["--quick"],
    "inference": ["--repeats", "20", "--no-cpp"],
}


def _table(k) -> Dict[str, float]:
    lf = k["per_load_factor"][0]
    return {f"{n} Mkeys/s (rate)": lf[n] for n in ("lookup_hit", "lookup_miss", "insert", "lookup_gather")
            if lf.get(n)}


def _embedding(k) -> Dict[str, float]:
    return {f"{opt} {m}": r[m] for opt, r in k["optimizers"].items() for m in ("ours_train_ms", "ours_eval_ms")
            if m in r}


def _torchrec(k) -> Dict[str, float]:
    return {f"{n} step_ms": m["step_ms"] for n, m in k["models"].items() if "step_ms" in m}


def _tiers(k) -> Dict[str, float]:
    out = {"in_memory step_ms": k["in_memory_step_ms"]}
    for name, pts in k["series"].items():
        for p in pts:
            out[f"{name} @{p['cache_fraction']:g} step_ms"] = p["step_ms"]
    return out


def _inference(k) -> Dict[str, float]:
    # Each case's rate against TorchRec's quantized EBC measured in the same run (the bench's own ratio).
    return {f"{name} vs torchrec int8 (rate)": c["vs_torchrec_int8"] for name, c in k["cases"].items()
            if "cold" not in name and "torchrec" not in name}


HEADLINES: Dict[str, Callable[[dict], Dict[str, float]]] = {
    "table": _table, "embedding": _embedding, "torchrec": _torchrec, "tiers": _tiers, "inference": _inference}


def run_once(checkout: str, name: str, python: str) -> Dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
        script = os.path.join(checkout, "benchmark", f"bench_{name}.py")
        subprocess.run([python, script, *SETTINGS[name], "--out", out], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=900)
        with open(out) as f:
            return HEADLINES[name](KEY_NUMBERS[name](json.load(f)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--new", default=".")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(SETTINGS))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ab_compare.json"))
    args = ap.parse_args()
    sides = {"base": args.base, "new": args.new}
    samples: Dict[str, Dict[str, Dict[str, List[float]]]] = {}
    for name in args.only.split(","):
        per = samples.setdefault(name, {})
        for r in range(args.rounds):
            order = ("base", "new") if r % 2 == 0 else ("new", "base")  # alternate who goes first
            for side in order:
                for metric, v in run_once(sides[side], name, sys.executable).items():
                    per.setdefault(metric, {}).setdefault(side, []).append(v)
            print(f"[ab] {name}: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    print(f"{'benchmark':10} {'number':48} {'base':>10} {'new':>10} {'new/base':>9} {'spread':>7}")
    for name, per in samples.items():
        for metric, vals in per.items():
            if set(vals) != {"base", "new"}:
                continue
            b, n = statistics.median(vals["base"]), statistics.median(vals["new"])
            # run-to-run spread of the base side: (max - min) / median
            spread = (max(vals["base"]) - min(vals["base"])) / b if b else 0.0
            rows.append(dict(benchmark=name, number=metric, base=b, new=n, ratio=n / b if b else None,
                             base_spread=spread, samples=vals))
            print(f"{name:10} {metric:48} {b:10.2f} {n:10.2f} {n / b:9.3f} {spread:7.1%}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {"base": args.base, "new": args.new, "rounds": args.rounds, "settings": SETTINGS},
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
