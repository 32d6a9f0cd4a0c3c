#!/usr/bin/env bash
# Builds the C++ serving client against the installed torch (libtorch only,
# no Python at run time) and prints the executable's path. Incremental: a
# second run with nothing changed takes well under a second.
#   examples/serve_cpp/build.sh [BUILD_DIR]      (default: build/serve_cpp of this checkout)
# PYTHON: the python whose torch to build against (default: python3);
# SERVE_CPP_TSAN=1: with ThreadSanitizer (default BUILD_DIR build/serve_cpp_tsan).
# CMake (find_package(Torch)) when it is installed, else one c++ line
# (SERVE_CPP_NO_CMAKE=1 forces that; CXX names the compiler).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
TSAN=OFF SUFFIX=""
if [ "${SERVE_CPP_TSAN:-0}" = 1 ]; then TSAN=ON SUFFIX=_tsan; fi
BUILD=${1:-$ROOT/build/serve_cpp$SUFFIX}
PY=${PYTHON:-python3}
if ! command -v cmake > /dev/null || [ "${SERVE_CPP_NO_CMAKE:-0}" = 1 ]; then
  # No cmake: one compiler line with torch's include and library folders.
  CXX=${CXX:-c++}
  mkdir -p "$BUILD"
  exe=$BUILD/serve_cpp
  if [ ! -x "$exe" ] || [ "$HERE/serve.cpp" -nt "$exe" ] || [ "$HERE/safetensors.h" -nt "$exe" ]; then
    read -r torch_dir abi < <("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__), int(torch._C._GLIBCXX_USE_CXX11_ABI))')
    flags=()
    if [ "$TSAN" = ON ]; then flags=(-fsanitize=thread -g); fi
    "$CXX" -O2 -std=c++20 "${flags[@]}" -D_GLIBCXX_USE_CXX11_ABI="$abi" -I"$torch_dir/include" \
      -I"$torch_dir/include/torch/csrc/api/include" "$HERE/serve.cpp" -o "$exe.tmp" -L"$torch_dir/lib" \
      -Wl,-rpath,"$torch_dir/lib" -ltorch -ltorch_cpu -lc10 -ldl -pthread > "$BUILD/build.log" 2>&1 \
      || { cat "$BUILD/build.log" >&2; exit 1; }
    mv -f "$exe.tmp" "$exe"
  fi
  echo "$exe"
  exit 0
fi
prefix=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
mkdir -p "$BUILD"
# (Re)configure when new or built against another torch.
if [ "$(cat "$BUILD/torch_prefix.txt" 2>/dev/null)" != "$prefix" ]; then
  gen=()
  if command -v ninja > /dev/null; then gen=(-G Ninja); fi
  rm -f "$BUILD/CMakeCache.txt"
  cmake -S "$HERE" -B "$BUILD" "${gen[@]}" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
    -DSERVE_CPP_TSAN=$TSAN > "$BUILD/configure.log" 2>&1 \
    || { cat "$BUILD/configure.log" >&2; exit 1; }
  echo "$prefix" > "$BUILD/torch_prefix.txt"
fi
cmake --build "$BUILD" > "$BUILD/build.log" 2>&1 || { cat "$BUILD/build.log" >&2; exit 1; }
echo "$BUILD/serve_cpp"
