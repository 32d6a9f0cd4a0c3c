#!/usr/bin/env bash
# Compiles every csrc/**/*.cu to an object with nvcc (sm_80, sm_90) against
# the environment's torch headers: the CUDA sources stay compilable on a
# machine without a GPU or a CUDA build of torch. The nvcc flags are setup.py's
# (-fmad=false included: the kernels' float results depend on it).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${DYNAMICEMB_VENV:-$ROOT/.venv}/bin/python
mapfile -t files < <(find "$ROOT/csrc" -name '*.cu' | sort)
if [ ${#files[@]} -eq 0 ]; then echo "[nvcc] no .cu files"; exit 0; fi
torch_dir=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
py_inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for f in "${files[@]}"; do
  echo "[nvcc] $f"
  nvcc -c "$f" -o "$out/$(basename "$f").o" -std=c++20 -O3 -fmad=false -Xcompiler -fPIC \
    -D_GLIBCXX_USE_CXX11_ABI=1 -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE -DDYNAMICEMB_WITH_CUDA \
    --expt-relaxed-constexpr -I"$ROOT/csrc" -I"$torch_dir/include" \
    -I"$torch_dir/include/torch/csrc/api/include" -I"$py_inc" \
    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
done
echo "[nvcc] ${#files[@]} file(s) compiled"
