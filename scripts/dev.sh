#!/usr/bin/env bash
# Sets everything up (idempotent, fast when nothing changed), then runs:
#   scripts/dev.sh example [args]   the main job (example.py, 2 CPU ranks)
#   scripts/dev.sh test [pytest args]
#   scripts/dev.sh bench NAME [args] benchmark/bench_NAME.py
#   scripts/dev.sh python [args]    the environment's python
# The environment is .venv beside this checkout (DYNAMICEMB_VENV overrides).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${DYNAMICEMB_VENV:-$ROOT/.venv}
cd "$ROOT"

# 1. A virtual environment with the pinned dependencies; a stamp named after
#    the requirement files' hash skips this step when they did not change.
deps_hash=$(cat requirements.txt requirements-torchrec.txt | sha256sum | cut -c1-16)
if [ ! -f "$VENV/.deps-$deps_hash" ]; then
  echo "[dev] installing dependencies into $VENV" >&2
  [ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r requirements-torchrec.txt
  rm -f "$VENV"/.deps-*
  touch "$VENV/.deps-$deps_hash"
fi
PY="$VENV/bin/python"

# 2. This checkout on the environment's path (an editable install by hand).
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ROOT" > "$site/dynamicemb-dev.pth"

# 3. The ops library: ninja rebuilds only what changed, under build/; the
#    library is then installed into dynamicemb/lib/ by an atomic rename, and
#    only when it changed, so processes that have the old one loaded keep working.
"$PY" setup.py -q build_ext --build-lib build/lib > "$VENV/build.log" 2>&1 || {
  cat "$VENV/build.log" >&2
  exit 1
}
mkdir -p dynamicemb/lib
rm -f dynamicemb/_C.*.so  # the former Python extension module (the ops now live in lib/)
built=build/lib/dynamicemb/lib/libdynamicemb_ops.so
dest=dynamicemb/lib/libdynamicemb_ops.so
if ! cmp -s "$built" "$dest"; then
  cp "$built" "$dest.tmp.$$" && mv -f "$dest.tmp.$$" "$dest"
fi

cmd=${1:-example}
shift || true
case "$cmd" in
  example) exec "$PY" example.py "$@" ;;
  test)
    set +e
    "$PY" -m pytest "$@"
    rc=$?
    [ $rc -eq 5 ] && { echo "[dev] no tests were collected" >&2; exit 1; }
    exit $rc
    ;;
  bench) name=$1; shift; exec "$PY" "benchmark/bench_$name.py" "$@" ;;
  python) exec "$PY" "$@" ;;
  *) echo "usage: scripts/dev.sh {example|test|bench NAME|python} [args]" >&2; exit 2 ;;
esac
