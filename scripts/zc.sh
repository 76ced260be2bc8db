#!/usr/bin/env bash
# The one entry point for a fresh machine: installs what zerocore needs (only what is
# missing), then runs a job.
#   bash scripts/zc.sh demo [args]   # the demo training run
#   bash scripts/zc.sh test [args]   # native kernel tests (ctest) + the pytest suite
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
job=${1:-}
shift || true
case "$job" in demo|test) ;; *) echo "usage: bash scripts/zc.sh demo|test [args]" >&2; exit 2 ;; esac

# System packages: a C++ compiler and cmake for the native code, libaio-dev for NVMe I/O.
missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
[ -f /usr/include/libaio.h ] || missing+=(libaio-dev)
[ -f /usr/include/liburing.h ] || missing+=(liburing-dev)  # optional io_uring backend of NVMe I/O
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "zerocore: installing ${missing[*]} (apt)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; } ||
      echo "zerocore: warning: could not install ${missing[*]}; NVMe I/O will be reported unavailable" >&2
  else
    echo "zerocore: warning: missing ${missing[*]} and cannot apt-get install here" >&2
  fi
fi

# torch pinned: a bare requirement would pull a multi-GB CUDA build. Keep a torch already there.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q ninja "setuptools>=64" wheel
# --no-build-isolation: compile against the torch above. Editable, so `python -m pytest` from
# this folder and the installed package are the same code.
"$PY" -m pip install -q --no-build-isolation -e ".[test]"

if [ "$job" = demo ]; then
  exec "$PY" -m zerocore demo "$@"
fi

cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cmake
ctest --test-dir build/cmake --output-on-failure
exec "$PY" -m pytest -q -m "not slow" tests "$@"
