#!/usr/bin/env bash
# A/B of two builds of the ops library on the GPU machine, after gpu_check.sh
# (which installs the wheels into /tmp/site): bench_table alternates the two
# libraries, one process each, ROUNDS times, and prints each run's rates
# (2^30 keys/s per load factor and op) and the medians side by side. Same
# machine, alternating: machine-to-machine the same build moved about 20%
# (docs/gpu/h200-2026-11-27).
#
# Build both here with scripts/gpu_prebuild.sh: the working tree's goes to
# .devbuild/libdynamicemb_ops.so; GPU_PREBUILD_REV=<commit> builds a commit
# (in a temporary worktree) to .devbuild/lib-<commit>.so. Carry .devbuild.
#
# Usage: scripts/gpu_ab.sh OUTDIR LIB_A LIB_B [ROUNDS (3)] [bench_table args]
#   e.g. scripts/gpu_ab.sh $OUT/ab .devbuild/lib-fc38ff3.so .devbuild/libdynamicemb_ops.so
set -uo pipefail
OUT=${1:?usage: scripts/gpu_ab.sh OUTDIR LIB_A LIB_B [ROUNDS] [bench_table args]}
A=${2:?LIB_A}
B=${3:?LIB_B}
ROUNDS=${4:-3}
shift 4 2>/dev/null || shift $#
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${GPU_CHECK_SITE:-/tmp/site}:$ROOT
LIB=dynamicemb/lib/libdynamicemb_ops.so
KEEP=$(mktemp)
cp "$LIB" "$KEEP" 2>/dev/null
trap 'cp "$KEEP" "$LIB" 2>/dev/null; rm -f "$KEEP"' EXIT
for r in $(seq 1 "$ROUNDS"); do
  for v in a b; do
    lib=$A; [ $v = b ] && lib=$B
    cp "$lib" "$LIB"
    timeout 60 python3 benchmark/bench_table.py --device cuda --repeats 3 "$@" --out "$OUT/bench_table_${v}_$r.json" \
      > "$OUT/bench_table_${v}_$r.log" 2>&1 || echo "[gpu_ab] $v round $r failed (exit $?): $OUT/bench_table_${v}_$r.log"
  done
done
python3 - "$OUT" "$A" "$B" <<'EOF'
import glob, json, os, statistics, sys
out, libs = sys.argv[1], {"a": sys.argv[2], "b": sys.argv[3]}
rates = {}
for v in "ab":
    for f in sorted(glob.glob(os.path.join(out, f"bench_table_{v}_*.json"))):
        d = json.load(open(f))
        for st in d["stages"]:
            for op, m in st["measurements"].items():
                rates.setdefault(f"LF {st['load_factor']} {op}", {}).setdefault(v, []).append(round(m["gkeys_per_s"], 3))
rows = {k: {v: {"runs": xs, "median": statistics.median(xs)} for v, xs in r.items()} for k, r in rates.items()}
json.dump({"libs": libs, "rates_gkeys_per_s": rows}, open(os.path.join(out, "ab.json"), "w"), indent=1)
print(f"{'2^30 keys/s':32s} {'a (' + os.path.basename(libs['a']) + ')':>28s} {'b (' + os.path.basename(libs['b']) + ')':>28s}")
for k, r in rows.items():
    cell = lambda v: f"{r[v]['median']:.2f} ({', '.join(f'{x:.2f}' for x in r[v]['runs'])})" if v in r else "-"
    print(f"{k:32s} {cell('a'):>28s} {cell('b'):>28s}")
EOF
