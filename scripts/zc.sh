#!/usr/bin/env bash
# The one entry point for a fresh machine: installs what zerocore needs into a virtual
# environment of its own (.venv in this checkout; only what is missing), then runs a job.
#   bash scripts/zc.sh demo [args]   # the demo training run
#   bash scripts/zc.sh test [args]   # native kernel tests (ctest) + the pytest suite
# Environment:
#   ZC_MINIMAL=1     test: skip the optional libraries the compatibility tests compare against
#                    (deepspeed, transformers, trl, peft, lightning, accelerate); those tests skip
#   PYTHON=/path     use this interpreter (and whatever environment it belongs to) instead of .venv
#   ZC_TORCH_INDEX   the PyTorch wheel index tried first for torch (default: the CPU or CUDA one
#                    that fits this machine)
#   ZC_STDINC=0      test: skip the check of csrc/ against a newer libstdc++ (ZC_STDINC_REQUIRE=1:
#                    fail when no newer compiler can be had instead of warning)
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0
job=${1:-}
shift || true
case "$job" in demo|test) ;; *) echo "usage: bash scripts/zc.sh demo|test [args]" >&2; exit 2 ;; esac
say() { echo "zerocore: $*"; }

# ---- system packages: a C++ compiler and cmake for the native code, libaio-dev for NVMe I/O,
# the venv module (Debian ships it apart from python3)
missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
[ -f /usr/include/libaio.h ] || missing+=(libaio-dev)
[ -f /usr/include/liburing.h ] || missing+=(liburing-dev)  # optional io_uring backend of NVMe I/O
if [ -z "${PYTHON:-}" ] && ! python3 -c "import ensurepip, venv" 2>/dev/null; then missing+=(python3-venv); fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing ${missing[*]} (apt)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; } ||
      echo "zerocore: warning: could not install ${missing[*]}; NVMe I/O will be reported unavailable" >&2
  else
    echo "zerocore: warning: missing ${missing[*]} and cannot apt-get install here" >&2
  fi
fi

# ---- the Python environment. A venv of our own: system Pythons that follow PEP 668 (Debian 12,
# Ubuntu 23.04+) refuse `pip install`, and the user's site-packages stay untouched.
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  state=build/zc-state/$(printf %s "$(command -v "$PY" || echo "$PY")" | cksum | cut -d' ' -f1)
  where="$PY's environment"
else
  if [ ! -x .venv/bin/python ]; then
    say "creating the virtual environment .venv"
    python3 -m venv .venv || { echo "zerocore: error: python3 -m venv failed; install python3-venv" \
                                    "(apt-get install python3-venv) or give PYTHON=/path/to/python" >&2; exit 1; }
  fi
  PY=.venv/bin/python
  state=.venv/zc-state
  where=.venv
fi
mkdir -p "$state"
# its console scripts (ninja, which torch's extension builds look for on PATH) come first
PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
export PATH
pip() { "$PY" -m pip --disable-pip-version-check "$@"; }

# ---- torch, pinned. PyPI's Linux torch is the CUDA build (gigabytes of NVIDIA libraries): where
# no NVIDIA GPU is present take the CPU build from PyTorch's CPU index, tried briefly (where it is
# unreachable pip moves on at once to the configured indexes).
have_gpu() { [ -e /dev/nvidia0 ] || { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; }
installed_torch=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || true)
if [ "${installed_torch%%+*}" != "$TORCH_VERSION" ]; then
  if [ -n "${PYTHON:-}" ] && [ -n "$installed_torch" ]; then
    echo "zerocore: warning: $PY has torch $installed_torch; zerocore is built and tested with $TORCH_VERSION" \
         "(keeping yours)" >&2
  else
    if have_gpu; then build="CUDA build"; index=${ZC_TORCH_INDEX:-}
    else build="CPU build"; index=${ZC_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}; fi
    say "installing torch $TORCH_VERSION ($build) into $where (about a minute)"
    extra=()
    [ -n "$index" ] && extra=(--extra-index-url "$index" --timeout 10 --retries 0)
    if ! pip install -q "${extra[@]}" "torch==$TORCH_VERSION"; then
      [ -n "$index" ] || exit 1
      say "$index did not answer; installing torch $TORCH_VERSION from the configured indexes"
      pip install -q "torch==$TORCH_VERSION"
    fi
    installed_torch=$("$PY" -c "import torch; print(torch.__version__)")
    if ! have_gpu && "$PY" -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
      echo "zerocore: note: only a CUDA build of torch was offered ($installed_torch); it runs on the CPU too" >&2
    fi
  fi
fi
# Every later install keeps this torch: a constraint, so no dependency upgrades it. Exported, so
# the isolated environments pip builds source packages in get it too.
echo "torch==${installed_torch%%+*}" > "$state/constraints.txt"
export PIP_CONSTRAINT="$PWD/$state/constraints.txt"

say "checking the build and test tools in $where"
pip install -q ninja "setuptools>=64" wheel tqdm "pytest>=7" numpy safetensors crc32c

# ---- the package and its native extension, rebuilt only when its sources or torch changed
stamp=$( { printf '%s\n' "$installed_torch" "$("$PY" -c 'import sys; print(sys.version)')";
           find csrc -type f | LC_ALL=C sort | xargs cat; cat setup.py zerocore/ops/build_spec.py; } | cksum)
if [ -f "$state/build.stamp" ] && [ "$(cat "$state/build.stamp")" = "$stamp" ] &&
   "$PY" -c "import zerocore._C" 2>/dev/null; then
  say "extension up to date, skipping build"
else
  say "building the native extension against torch $installed_torch (about 1-3 min)"
  rm -f "$state/build.stamp"
  # --no-build-isolation: compile against the torch above. Editable, so `python -m pytest` from
  # this folder and the installed package are the same code.
  pip install -q --no-build-isolation --no-deps -e .
  echo "$stamp" > "$state/build.stamp"
fi

if [ "$job" = demo ]; then
  exec "$PY" -m zerocore demo "$@"
fi

# ---- the libraries the compatibility tests compare against (each such test skips without its
# library). DS_BUILD_OPS=0: DeepSpeed's ops are JIT-built when a test needs one, not at install.
if [ "${ZC_MINIMAL:-0}" != 0 ]; then
  say "ZC_MINIMAL set: not installing deepspeed, transformers, trl, peft, lightning, accelerate (their tests skip)"
  present=$("$PY" -c "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m)))" \
            deepspeed transformers trl peft lightning accelerate)
  [ -z "$present" ] || say "note: $where already has $present (from an earlier run); remove .venv for a run without"
else
  optional=(deepspeed transformers trl peft lightning accelerate)
  if ! "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" \
       "${optional[@]}"; then
    say "installing ${optional[*]} for the compatibility tests (a few minutes the first time; ZC_MINIMAL=1 skips)"
    DS_BUILD_OPS=0 pip install -q "${optional[@]}"
  fi
fi

# Every csrc/ source compiled (syntax only) with a libstdc++ >= 13: a source that forgets a
# standard #include builds with Debian 12's libstdc++ 12 and fails with newer g++ (it happened).
# The machine's own g++ where it is new enough, else Debian 13's g++ 14 fetched once into
# ~/.cache/zerocore; about a minute. Without network it warns loudly and goes on (ZC_STDINC_REQUIRE=1
# makes that an error); ZC_STDINC=0 skips it. Why this way: scripts/check_std_includes.py.
say "checking csrc/ for missing standard includes against a newer libstdc++"
"$PY" scripts/check_std_includes.py

say "building and running the native kernel tests (ctest)"
cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cmake
ctest --test-dir build/cmake --output-on-failure
say "running the pytest suite (-m 'not slow')"
exec "$PY" -m pytest -q -m "not slow" tests "$@"
