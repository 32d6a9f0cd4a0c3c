#!/usr/bin/env bash
# Builds the ops library with its CUDA kernels (sm_90) for the GPU machine's
# torch, here, without a GPU: gpu_check.sh then loads it in place of its own
# build (90-100 s of the device's time a run, a fresh machine each run).
#
# The library links libtorch alone (setup.py: py_limited_api), so it does not
# depend on the Python version; it must match the device's torch exactly
# (2.11.0+cu130, see ../shared/FACTS.md) and its nvcc (13.0). The torch wheel
# (PyPI's cp312 manylinux build, 530 MB) is downloaded once and only its
# include/ and lib/ are unpacked; ninja rebuilds only what changed (objects in
# the cache, not in .devbuild/: 2-4 minutes from scratch here, one .cu file
# about a minute).
#
# Usage: scripts/gpu_prebuild.sh  ->  .devbuild/libdynamicemb_ops.so
#   (git-ignored; run gpu_check with carry [".devbuild", ".whl"])
# GPU_PREBUILD_REV=<commit>: that commit's sources instead (a worktree in the
#   cache), to .devbuild/lib-<commit>.so, for scripts/gpu_ab.sh.
# GPU_PREBUILD_TORCH (2.11.0), GPU_PREBUILD_CACHE (/tmp/dynamicemb_torch_<ver>),
# GPU_PREBUILD_ARCHS ("90"), MAX_JOBS (the cores).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VER=${GPU_PREBUILD_TORCH:-2.11.0}
CACHE=${GPU_PREBUILD_CACHE:-/tmp/dynamicemb_torch_$VER}
OUT=$ROOT/.devbuild
SRC=$ROOT
LIB=libdynamicemb_ops.so
if [ -n "${GPU_PREBUILD_REV:-}" ]; then
  REV=$(git -C "$ROOT" rev-parse --short "$GPU_PREBUILD_REV")
  SRC=$CACHE/src-$REV
  [ -d "$SRC/csrc" ] || { rm -rf "$SRC"; mkdir -p "$SRC"; git -C "$ROOT" archive "$REV" csrc | tar -x -C "$SRC"; }
  LIB=lib-$REV.so
fi
BUILD=$CACHE/build-$(echo "$SRC" | md5sum | cut -c1-8)  # objects: outside what the device tool carries
ARCHS=${GPU_PREBUILD_ARCHS:-90}
CUDA=${CUDA_HOME:-/usr/local/cuda}
TORCH=$CACHE/site/torch
if [ ! -f "$TORCH/lib/libtorch_cuda.so" ]; then
  mkdir -p "$CACHE"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$CACHE" "torch==$VER"
  unzip -q -o "$CACHE"/torch-"$VER"-*.whl 'torch/include/*' 'torch/lib/*' 'torch/version.py' -d "$CACHE/site"
fi
grep -q "__version__ = '$VER+cu13" "$TORCH/version.py" || { echo "not a CUDA 13 torch $VER: $TORCH" >&2; exit 1; }
mkdir -p "$OUT" "$BUILD/obj"
EXCLUDE=$(git -C "$ROOT" rev-parse --git-path info/exclude)  # a worktree keeps it in the main .git
grep -qxF /.devbuild/ "$EXCLUDE" 2>/dev/null || echo /.devbuild/ >> "$EXCLUDE"

# setup.py's flags, and those torch's cpp_extension adds to every source.
INC="-I$SRC/csrc -I$TORCH/include -I$TORCH/include/torch/csrc/api/include -I$CUDA/include"
DEFS="-DTORCH_API_INCLUDE_EXTENSION_H -DPy_LIMITED_API=0x030A0000 -DTORCH_EXTENSION_NAME=libdynamicemb_ops \
-D_GLIBCXX_USE_CXX11_ABI=1 -DDYNAMICEMB_WITH_CUDA"
CXXFLAGS="-DNDEBUG -fPIC -O3 -std=c++20 -fvisibility=hidden -ffp-contract=off -g0 -fopenmp"
GENCODE=""
for a in $ARCHS; do GENCODE="$GENCODE -gencode arch=compute_$a,code=sm_$a"; done
NVFLAGS="-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
-D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr --compiler-options -fPIC -O3 -std=c++20 -fmad=false$GENCODE"
{
  echo "rule cxx"
  echo "  command = c++ -MMD -MF \$out.d $INC $DEFS $CXXFLAGS -c \$in -o \$out"
  echo "  depfile = \$out.d"
  echo "  deps = gcc"
  echo "rule nvcc"
  echo "  command = $CUDA/bin/nvcc -MD -MF \$out.d $INC $DEFS $NVFLAGS -c \$in -o \$out"
  echo "  depfile = \$out.d"
  echo "  deps = gcc"
  echo "rule link"
  echo "  command = c++ -shared -fopenmp \$in -L$TORCH/lib -lc10 -ltorch -ltorch_cpu -lc10_cuda -ltorch_cuda \
-L$CUDA/lib64 -lcudart -o \$out"
  objs=""
  while read -r src; do
    o=$BUILD/obj/${src//\//_}.o
    case $src in *.cu) r=nvcc ;; *) r=cxx ;; esac
    echo "build $o: $r $SRC/$src"
    objs="$objs $o"
  done < <(cd "$SRC" && find csrc -name '*.cpp' -o -name '*.cu' | sort)
  echo "build $OUT/$LIB: link$objs"
} > "$BUILD/build.ninja"
ninja -C "$BUILD" -j "${MAX_JOBS:-$(nproc)}"
echo "[prebuild] $OUT/$LIB for torch $VER, sm_$ARCHS${REV:+ (sources of $REV)}"
