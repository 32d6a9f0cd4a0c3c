#!/usr/bin/env bash
# Everything that can run on the GPU machine, in one run from a bare machine,
# in under 8 minutes (GPU_CHECK_BUDGET_S, default 450 s, bounds the steps):
#
#   install  the carried wheels (.whl/, made by scripts/gpu_wheels.sh) into
#            /tmp/site with --no-index --no-deps; PYTHONPATH=/tmp/site:repo
#            (fbgemm-gpu-cpu 1.6 + torchrec 1.6.1, torch 2.11's pairing)
#   build    the extension with its CUDA kernels, sm_90 only, in place, with the
#            system compiler (/usr/bin/gcc: the image's own CC, /opt/gcc, built an
#            extension that crashed at import); a failed import is diagnosed
#            (faulthandler per import, ldd, cuda-gdb backtrace) in the log
#   probe    (a) does torchrec import beside fbgemm-gpu-cpu, which TorchRec and
#            FBGEMM ops run on CUDA tensors, the host syncs of one training step
#            and its profile (scripts/gpu_probe.py; records only)
#   gpu_tests  (b) `pytest -m gpu tests`: every test that takes the `device`
#            fixture runs its cuda param (tests/conftest.py marks it gpu) and
#            tests/cuda (all gpu-marked) compares CUDA against the CPU
#   bench_table, bench_embedding  (e) the benchmarks that take --device, with
#            run_all.py's short settings (run_all.py itself has no --device);
#            bench_embedding with hybrid tables and nn.EmbeddingBag beside
#   example  (d) example.py --device cuda --nproc 1 with short settings; skipped
#            when the probe's DMP step fails (CPU fbgemm: TorchRec's input dist
#            has no CUDA kernels), with the reason
#   tier_inference_checkpoint_tests  (c) the rest of tests/tiers, inference,
#            checkpoint on the CPU (`-m "not gpu"`: their gpu-marked tests ran in
#            (b)); skipped unless torchrec is 1.8 (torch 2.11 pairs with 1.6.1)
#
# First run (H100, 2026-11-26): build 75-103 s, probe 12-18 s, gpu_tests about
# 60 s with 4 workers, each benchmark 7-12 s.
# Each step has its own log and time box and the run goes on after a failure.
# OUTDIR gets (at most 8 files, what the device tool brings back):
#   summary.json      every step's status, exit code, seconds, test counts,
#                     failed tests, the probe's results, what did not run and why
#   gpu_check.log     every step's log, one after the other
#   probe.json, bench_table.json, bench_embedding.json
#
# Usage: scripts/gpu_check.sh OUTDIR
# A carried .devbuild/libdynamicemb_ops.so (scripts/gpu_prebuild.sh) replaces the build when it
# loads with its CUDA kernels (GPU_CHECK_PREBUILT=0: build anyway).
# GPU_CHECK_ONLY=gpu_tests,example: a rerun of only those steps (install and
# build always run; both are quick on a warm machine, whose build/ is kept).
# GPU_CHECK_TESTS="tests/cuda tests/table": the paths (b) runs (default tests).
# GPU_CHECK_BUDGET_S (450), GPU_CHECK_XDIST_GPU (8), GPU_CHECK_XDIST (8):
# the time budget and the pytest-xdist workers of (b) and (c).
# GPU_CHECK_ALLOW_CPU=1: a dry run without a GPU: the same selections on the
# CPU (DYNAMICEMB_PARITY_DEVICE=cpu, smaller benchmarks) with GPU_CHECK_PYTHON
# (default .venv or ../main/.venv); the wheels are installed only if that
# python lacks torchrec; no CUDA build unless GPU_CHECK_CUDA_BUILD=1.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUTDIR=${1:?usage: scripts/gpu_check.sh OUTDIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
PTH=""
trap 'rm -rf "$WORK"; if [ -n "$PTH" ]; then rm -f "$PTH"; fi' EXIT
mkdir -p "$WORK/logs"
touch "$WORK/started"
LOG=$OUTDIR/gpu_check.log
: > "$LOG"
START=$(date +%s)
DEADLINE=$((START + ${GPU_CHECK_BUDGET_S:-450}))

DRY=${GPU_CHECK_ALLOW_CPU:-0}
SITE=${GPU_CHECK_SITE:-/tmp/site}
export PYTHONPATH=$ROOT
if [ "$DRY" = 1 ]; then
  MODE=cpu-dry
  if [ -n "${GPU_CHECK_PYTHON:-}" ]; then PY=$GPU_CHECK_PYTHON
  elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
  else PY=$ROOT/../main/.venv/bin/python; fi
  DEV=cpu
  SITE=${GPU_CHECK_SITE:-$WORK/site}
  export DYNAMICEMB_PARITY_DEVICE=cpu MAX_JOBS=${MAX_JOBS:-1}
  # GPU_CHECK_CUDA_BUILD=1: build the CUDA kernels too (a CUDA torch and nvcc, no GPU needed).
  if [ "${GPU_CHECK_CUDA_BUILD:-0}" = 1 ]; then export DYNAMICEMB_CUDA_ARCHS=90 TORCH_CUDA_ARCH_LIST=9.0
  else export DYNAMICEMB_NO_CUDA=1; fi
else
  MODE=gpu
  PY=${GPU_CHECK_PYTHON:-python3}
  DEV=cuda
  export DYNAMICEMB_CUDA_ARCHS=90 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16}
  # The system compiler, whose libstdc++ the process loads (README, GPUs: with a newer GCC
  # first on the image's PATH the extension built but crashed formatting an error message).
  # The image sets CC=/opt/gcc/bin/gcc itself, so it is overridden, not only filled in
  # (GPU_CHECK_CC=path keeps another).
  if [ -n "${GPU_CHECK_CC:-}" ]; then export CC=$GPU_CHECK_CC CXX=${GPU_CHECK_CXX:-${GPU_CHECK_CC%gcc}g++}
  elif [ -x /usr/bin/gcc ] && [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
fi

note() { echo "$*" >> "$WORK/notes.txt"; echo "[gpu_check] note: $*"; }
summarize() { python3 scripts/gpu_summary.py "$WORK" "$OUTDIR" "$MODE" 2>>"$LOG" || "$PY" scripts/gpu_summary.py "$WORK" "$OUTDIR" "$MODE"; }
record() {  # name status rc seconds reason
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5//$'\t'/ }" >> "$WORK/steps.tsv"
  if [ "$2" = skipped ]; then echo "[gpu_check] $1: not run - $5"
  else echo "[gpu_check] $1: $2 (exit $3, ${4} s)${5:+ - $5}"; fi
  summarize
}
skip() { record "$1" skipped "" "" "$2"; }

# step NAME BUDGET_S SIGNAL CMD...: runs CMD under `timeout` (the smaller of
# BUDGET_S and the time left), its output to logs/NAME.log and gpu_check.log.
# pytest gets SIGINT so it still writes its report; the rest SIGTERM.
step() {
  local name=$1 budget=$2 sig=$3; shift 3
  local now left t0 rc status reason=""
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ ",install,build,$GPU_CHECK_ONLY," != *",$name,"* ]]; then
    skip "$name" "not selected (GPU_CHECK_ONLY=$GPU_CHECK_ONLY)"; return 1
  fi
  now=$(date +%s); left=$((DEADLINE - now - 10))
  if [ "$left" -lt 20 ]; then skip "$name" "no time left within the ${GPU_CHECK_BUDGET_S:-450} s budget"; return 1; fi
  [ "$budget" -gt "$left" ] && budget=$left
  echo "[gpu_check] $name (time box ${budget}s): $*"
  { echo; echo "===== $name: $* (time box ${budget}s) ====="; } >> "$LOG"
  t0=$(date +%s.%N)
  timeout -s "$sig" -k 15 "$budget" "$@" > "$WORK/logs/$name.log" 2>&1
  rc=$?
  cat "$WORK/logs/$name.log" >> "$LOG"
  local secs; secs=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
  if [ $rc -eq 0 ]; then status=ok
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then  # timeout's own codes (TERM/INT, then KILL)
    status=timeout; reason="ran past its time box of ${budget} s"
  else status=failed; fi
  record "$name" "$status" "$rc" "$secs" "$reason"
  return $rc
}

# ---- environment --------------------------------------------------------------------------------
"$PY" - > "$WORK/env.json" 2>>"$LOG" <<'EOF'
import json, os, platform, shutil, subprocess, sys
import torch
e = {"python": sys.version.split()[0], "python_path": sys.executable, "torch": torch.__version__,
     "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "machine": platform.node(),
     "cpus": os.cpu_count(), "nvcc": shutil.which("nvcc"), "gcc_on_path": shutil.which("gcc"),
     "CC": os.environ.get("CC")}
if e["nvcc"]:
    e["nvcc_version"] = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
for cc in {e["gcc_on_path"], e["CC"]} - {None}:
    e[f"version of {cc}"] = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    e.update(gpu=p.name, gpu_sm=f"{p.major}.{p.minor}", gpu_mem_gib=round(p.total_memory / 2**30, 1))
smi = shutil.which("nvidia-smi")
if smi:
    e["nvidia_smi"] = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                     capture_output=True, text=True).stdout.strip()
print(json.dumps(e))
EOF
cat "$WORK/env.json" | tee -a "$LOG"
if [ "$MODE" = gpu ] && ! grep -q '"cuda_available": true' "$WORK/env.json"; then
  note "torch sees no CUDA device: a GPU run needs one (GPU_CHECK_ALLOW_CPU=1 runs the CPU dry run)"
  skip all "no CUDA device"
  exit 1
fi
note "benchmark/run_all.py has no --device option: (e) runs the benchmarks that take --device (bench_table.py, bench_embedding.py) with run_all.py's short settings on $DEV instead"
note "(c): the tier, inference and checkpoint tests that take a device run their cuda params in (b) gpu_tests (by_dir tests/tiers); the others run on the CPU, here under this machine's torch"

# ---- install -----------------------------------------------------------------------------------
# The carried wheels go to $SITE, first on PYTHONPATH, unless this python has torchrec already.
if "$PY" -c "import torchrec" > /dev/null 2>&1; then
  skip install "$PY already has torchrec: nothing installed"
elif ! ls .whl/*.whl > /dev/null 2>&1; then
  skip install "no .whl/*.whl in the working tree (run scripts/gpu_wheels.sh and name .whl in carry)"
else
  rm -rf "$SITE"
  if step install 90 TERM "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
       --target "$SITE" .whl/*.whl; then
    export PYTHONPATH=$SITE:$ROOT
    # Tests and example.py start fresh interpreters with PYTHONPATH=the repo only (serving
    # checks); a .pth file in the interpreter's site-packages shows them $SITE too (last).
    PTH=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_gpu_check_site.pth
    if ! echo "$SITE" > "$PTH" 2>/dev/null; then
      note "could not write $PTH: subprocesses that reset PYTHONPATH will not find torchrec"; PTH=""
    fi
  fi
fi

# ---- build -------------------------------------------------------------------------------------
BUILT=0
# torch links the extension with -L$CUDA_HOME/lib64 -lcudart; where the toolkit keeps
# libcudart elsewhere (lib/, or only torch's pip package has it), a shim on LIBRARY_PATH.
if [ "${DYNAMICEMB_NO_CUDA:-0}" != 1 ]; then
  rt=$("$PY" - 2>/dev/null <<'PYEOF'
import glob, os, site
from torch.utils import cpp_extension as c
home = c.CUDA_HOME or "/usr/local/cuda"
if not glob.glob(os.path.join(home, "lib64", "libcudart.so")):
    dirs = [os.path.join(h, d) for h in (home, "/usr/local/cuda") for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
    dirs += [os.path.join(p, "nvidia", d, "lib") for p in site.getsitepackages() for d in ("cu13", "cuda_runtime")]
    found = [f for d in dirs for f in sorted(glob.glob(os.path.join(d, "libcudart.so*")))]
    print(found[0] if found else "missing")
PYEOF
)
  if [ "$rt" = missing ]; then
    note "no libcudart.so found for the link: the build may fail"
  elif [ -n "$rt" ]; then
    mkdir -p "$WORK/cudalib" && ln -sf "$rt" "$WORK/cudalib/libcudart.so"
    export LIBRARY_PATH=$WORK/cudalib${LIBRARY_PATH:+:$LIBRARY_PATH}
    note "CUDA_HOME/lib64 has no libcudart.so: the build links against $rt"
  fi
fi
# A library built for this torch elsewhere (scripts/gpu_prebuild.sh, carried in .devbuild/)
# saves the build's 90-100 s; it is used only if it loads with its CUDA kernels.
build_or_prebuilt() {
  if [ "$MODE" = gpu ] && [ -f .devbuild/libdynamicemb_ops.so ] && [ "${GPU_CHECK_PREBUILT:-1}" = 1 ]; then
    mkdir -p dynamicemb/lib && cp .devbuild/libdynamicemb_ops.so dynamicemb/lib/libdynamicemb_ops.so
    if "$PY" -c "import torch, dynamicemb; assert torch._C._dispatch_has_kernel_for_dispatch_key('dynamicemb::table_insert', 'CUDA')"; then
      echo "prebuilt library (.devbuild/libdynamicemb_ops.so) loads with its CUDA kernels: no build"; return 0
    fi
    echo "the prebuilt library does not load here: building"
  fi
  "$PY" setup.py -q build_ext --inplace
}
if MODE=$MODE PY=$PY step build 300 TERM bash -c "$(declare -f build_or_prebuilt); build_or_prebuilt"; then
  "$PY" - > "$WORK/cuda_ops.json" 2>>"$LOG" <<'EOF'
import json, torch, dynamicemb  # noqa: F401  (loads the extension)
cuda = sorted(n for n in torch._C._dispatch_get_registrations_for_dispatch_key("CUDA") if n.startswith("dynamicemb::"))
cpu = sorted(n for n in torch._C._dispatch_get_registrations_for_dispatch_key("CPU") if n.startswith("dynamicemb::"))
print(json.dumps({"ops_with_cuda_kernels": len(cuda), "ops_with_cpu_kernels": len(cpu),
                  "cpu_only_ops": sorted(set(cpu) - set(cuda))}))
EOF
  if [ -s "$WORK/cuda_ops.json" ]; then BUILT=1; else
    note "the extension built but dynamicemb does not import: diagnosis (faulthandler) in gpu_check.log"
    diag() {  # label, python code: its exit code and the crash's stack into the log
      { echo "----- import diagnosis: $1"; "$PY" -X faulthandler -c "$2" 2>&1 | tail -25; echo "exit ${PIPESTATUS[0]}"; } >> "$LOG"
    }
    diag "fbgemm_gpu alone" "import fbgemm_gpu"
    diag "the extension alone" "import torch, glob; torch.ops.load_library(glob.glob('dynamicemb/lib/*.so')[0]); print('loaded')"
    diag "ldd of the extension" "import subprocess, glob; print(subprocess.run(['ldd', glob.glob('dynamicemb/lib/*.so')[0]], capture_output=True, text=True).stdout)"
    diag "dynamicemb" "import dynamicemb"
    if command -v cuda-gdb > /dev/null; then  # the native stack of the crash (the image has no gdb)
      { echo "----- import diagnosis: native backtrace (cuda-gdb)"
        timeout 90 cuda-gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" --args "$PY" -c "import dynamicemb" 2>&1 \
          | grep -v "^\[New Thread\|^\[Thread\|^warning:" | tail -60; } >> "$LOG"
    fi
    # A crash that comes from the carried CPU fbgemm: go on without it (TorchRec's steps are
    # then skipped; dynamicemb falls back to its own EmbOptimType).
    if ! "$PY" -c "import fbgemm_gpu" > /dev/null 2>&1; then
      if [ -n "$PTH" ]; then rm -f "$PTH"; PTH=""; fi  # the carried wheels out of every interpreter
      export PYTHONPATH=$ROOT
    fi
    if [ "$PYTHONPATH" = "$ROOT" ] && "$PY" -c "import dynamicemb" > /dev/null 2>&1; then
      note "fbgemm_gpu (the carried CPU build) crashes this torch: the steps run without the carried wheels"
      "$PY" - > "$WORK/cuda_ops.json" 2>>"$LOG" <<'EOF2'
import json, torch, dynamicemb  # noqa: F401
cuda = sorted(n for n in torch._C._dispatch_get_registrations_for_dispatch_key("CUDA") if n.startswith("dynamicemb::"))
print(json.dumps({"ops_with_cuda_kernels": len(cuda), "without_carried_wheels": True}))
EOF2
      [ -s "$WORK/cuda_ops.json" ] && BUILT=1
    fi
  fi
  summarize
fi
need_build() { [ $BUILT = 1 ] || { skip "$1" "the extension did not build or import (see build)"; return 1; }; }

# ---- (a) probe ---------------------------------------------------------------------------------
TORCHREC=0
if need_build probe; then
  step probe 120 TERM "$PY" scripts/gpu_probe.py "$OUTDIR/probe.json" --device "$DEV"
  summarize
  "$PY" -c "import torchrec.distributed, dynamicemb.shard" > /dev/null 2>&1 && TORCHREC=1
  # Whether a DMP step of our tables runs on this device (the probe tried one): without
  # the CUDA build of fbgemm-gpu, TorchRec's input dist has no CUDA kernels.
  DMP_WHY=$("$PY" - "$OUTDIR/probe.json" 2>/dev/null <<'EOF2'
import json, sys
c = json.load(open(sys.argv[1]))["checks"].get("dmp_dynamic_tables_train", {"ok": False, "error": "not probed"})
print("" if c["ok"] else "a DistributedModelParallel step does not run here: " + c["error"][:200])
EOF2
)
  # The TorchRec version our integration is written against (requirements.txt).
  TORCHREC_OK=$("$PY" -c "import torchrec, sys; v = tuple(int(x) for x in torchrec.__version__.split('.')[:2]); print(int(v >= (1, 8)))" 2>/dev/null || echo 0)
fi

# ---- (b) every gpu-marked test and every device-fixture test, on CUDA --------------------------
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rfE --continue-on-collection-errors)
# pytest-xdist workers (the GPU machine has 16 cores; none here by default: 2 shared cores).
if [ "$DRY" = 1 ]; then XB=${GPU_CHECK_XDIST_GPU:-0}; XC=${GPU_CHECK_XDIST:-0}
else XB=${GPU_CHECK_XDIST_GPU:-8}; XC=${GPU_CHECK_XDIST:-8}; fi
xdist() { if [ "$1" -gt 0 ]; then echo "-n $1"; fi; }
if need_build gpu_tests; then
  # shellcheck disable=SC2046
  # shellcheck disable=SC2086
  step gpu_tests 200 INT "${PYTEST[@]}" $(xdist "$XB") -m gpu --junitxml="$WORK/gpu_tests.xml" ${GPU_CHECK_TESTS:-tests}
fi

# ---- (e) benchmarks with --device --------------------------------------------------------------
if need_build bench_table; then
  if [ "$DRY" = 1 ]; then TARGS=(--slots $((1 << 20)) --batch $((1 << 16)) --repeats 1); else TARGS=(--repeats 3); fi
  step bench_table 90 TERM "$PY" benchmark/bench_table.py --device "$DEV" "${TARGS[@]}" --out "$OUTDIR/bench_table.json"
fi
if need_build bench_embedding; then
  # --hbm-share 0.5: hybrid tables beside, half their rows in pinned host memory (issue 32: <= 1.5x)
  if [ "$DRY" = 1 ]; then EARGS=(--key-range 100000 --capacity $((1 << 16)) --batch 512 --steps 2 --warmup 1)
  else EARGS=(--key-range 1000000 --capacity $((1 << 18)) --steps 8 --warmup 3); fi
  # --torch-bags: nn.EmbeddingBag(sparse=True) with SGD / SparseAdam beside (issue 32: ours / bag <= 1.25)
  EARGS+=(--hbm-share 0.5 --torch-bags)
  step bench_embedding 90 TERM "$PY" benchmark/bench_embedding.py --device "$DEV" "${EARGS[@]}" \
    --out "$OUTDIR/bench_embedding.json"
fi

# ---- (d) example.py on one GPU -----------------------------------------------------------------
if need_build example; then
  if [ $TORCHREC = 1 ] && [ -n "${DMP_WHY:-}" ] && [ "$DRY" != 1 ]; then
    skip example "$DMP_WHY"
  elif [ $TORCHREC = 1 ]; then
    step example 120 TERM "$PY" example.py --device "$DEV" --nproc 1 --steps 40 --batch-size 256 --log-every 20 \
      --delta-steps 10 --eval-batches 4 --out "$WORK/example_out"
  else
    skip example "torchrec (or dynamicemb's TorchRec part) does not import here: see probe.json"
  fi
fi

# ---- (c) the other tier, inference and checkpoint tests ----------------------------------------
if need_build tier_inference_checkpoint_tests; then
 if [ "${TORCHREC_OK:-0}" != 1 ] && [ "$DRY" != 1 ]; then
  # These run on the CPU (their CUDA params ran in (b)); most build a DMP model, whose
  # sharders are written against torchrec 1.8's API, and CI runs them all under it.
  skip tier_inference_checkpoint_tests "torchrec here is not 1.8 (torch 2.11's image pairs with torchrec 1.6.1 only): these CPU tests build DMP models against 1.8's API; CI runs them"
 else
  # shellcheck disable=SC2046
  step tier_inference_checkpoint_tests 240 INT "${PYTEST[@]}" $(xdist "$XC") -m "not gpu" \
    --junitxml="$WORK/tier_inference_checkpoint_tests.xml" tests/tiers tests/inference tests/checkpoint
 fi
fi

summarize
python3 - "$OUTDIR/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"[gpu_check] {s['mode']} on {s.get('gpu') or 'no GPU'}: tests {s['test_totals']}, wall {s.get('wall_s')} s")
for name, st in s["steps"].items():
    extra = st.get("pytest_says") or st.get("reason") or ""
    print(f"[gpu_check]   {name:34s} {st['status']:8s} {extra}")
for n in s.get("not_run", []):
    print(f"[gpu_check] not run: {n['part']}: {n['why']}")
sys.exit(1 if s.get("failed") else 0)  # a step failed or ran past its time box
EOF
