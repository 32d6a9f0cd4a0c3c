#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the cp312 x86-64 wheels that the GPU
# machine lacks, so that one device call can carry them (`carry: [".whl"]`)
# and scripts/gpu_check.sh can install them with --no-index --no-deps.
#
# The GPU machine's image has CUDA torch 2.11 (python 3.12), tqdm, numpy,
# cloudpickle, lightning-utilities, portalocker, pyre-extensions,
# typing-inspect and mypy-extensions, but no torchrec and no fbgemm-gpu.
# fbgemm X.Y pairs with exactly one torch minor (1.5 <-> 2.10, 1.6 <-> 2.11,
# 1.7 <-> 2.12, 1.8 <-> 2.13); a mismatch fails at import (fbgemm-gpu-cpu 1.7
# does not load on torch 2.11: "Could not load this library"), so the CPU
# build of the 2.11 pairing is the one carried. torchrec 1.7 and 1.8 import
# fbgemm_gpu.tbe.monitoring, which fbgemm 1.6 lacks, so torchrec 1.6.1 (its
# own pairing) goes with it. The CUDA fbgemm-gpu (~500 MB) cannot travel.
#   fbgemm-gpu-cpu 1.6.0  the torch 2.11 pairing (cp312 manylinux)
#   torchrec 1.6.1        pure Python; imports iopath (needs portalocker: there)
#   tensordict 0.15.3     pure Python (needs torch >= 2.11), + pyvers
#   torchmetrics 1.0.3    torchrec pins it exactly (the image has 1.9.0)
# Usage: scripts/gpu_wheels.sh [DEST]   (default .whl); PYTHON picks the pip.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${1:-$ROOT/.whl}
PY=${PYTHON:-python3}
WHEELS=(fbgemm-gpu-cpu==1.6.0 torchrec==1.6.1 iopath==0.1.9 tensordict==0.15.3 pyvers==0.2.3 torchmetrics==1.0.3)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: a stale one would stop the whole install there
# pip matches manylinux_2_N exactly: name each N the wheels may carry.
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do plats+=(--platform "$p"); done
for w in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plats[@]}" -d "$DEST" "$w"
done
dups=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | sort | uniq -d)
[ -z "$dups" ] || { echo "[wheels] two versions of: $dups (remove the stale ones)" >&2; exit 1; }
du -cb "$DEST"/*.whl | tail -1 | awk '{printf "[wheels] %d files, %.1f MiB in %s\n", n, $1/1048576, d}' \
  n="$(ls "$DEST"/*.whl | wc -l)" d="$DEST"
