#!/usr/bin/env bash
# One GPU session's checks, each step with its own time limit, results written under $OUT as they come
# (a step that times out or fails does not stop the next). Run on a lent GPU machine from the checkout:
#   OUT=/some/dir bash scripts/gpu_check.sh [steps...]       # default: build env tests step offload
# Steps:
#   build    TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation --no-deps -e . ; zerocore env
#   env      zerocore env (what was built, with which compiler)
#   tests    the GPU tests, one file per process, a crash named (scripts/gpu_tests.py)
#   step     benchmarks/step.py --device cuda: torch AMP and zerocore stages 0-3 on the 337M GPT, memory net of
#            each variant's baseline, left after del / after gc
#   offload  benchmarks/offload_states.py on the same GPT: device memory freed, round trip vs the pinned copy rate
# Environment: PY (default python3), ZC_ARCH (default 9.0), T_BUILD/T_TESTS/T_STEP/T_OFFLOAD (seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder for the results}
PY=${PY:-python3}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(build env tests step offload)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary="$OUT/summary.txt"
note() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$summary"; }
run() {  # run NAME SECONDS CMD...: output to $OUT/NAME.log, status and time to the summary
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  note "$name: rc=$rc in $((SECONDS - t0)) s (limit $limit)$([ $rc = 124 ] && echo ' TIMED OUT')"
  tail -n 25 "$OUT/$name.log"
  return 0
}
GPT=(--vocab 32768 --dim 1024 --layers 24 --heads 16 --ctx 1024 --batch 8)
note "machine: $(nvidia-smi -L 2>/dev/null | head -1); $($PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__)')"
for s in "${steps[@]}"; do
  case $s in
    build)
      run build "${T_BUILD:-300}" env TORCH_CUDA_ARCH_LIST="${ZC_ARCH:-9.0}" MAX_JOBS=16 \
        "$PY" -m pip install --no-build-isolation --no-deps --no-index -v -e . ;;
    env)
      run env 60 "$PY" -m zerocore env ;;
    tests)
      run tests "${T_TESTS:-300}" "$PY" scripts/gpu_tests.py --out "$OUT/gpu_tests.json" --timeout 150 ;;
    step)
      run step "${T_STEP:-240}" "$PY" benchmarks/step.py --device cuda --ranks 1 "${GPT[@]}" --steps 5 --rounds 2 \
        --warmup 2 --variants torch_amp zerocore_stage0 zerocore_stage1 zerocore_stage2 zerocore_stage3 \
        --out "$OUT/step_gpt337M.json" ;;
    offload)
      run offload "${T_OFFLOAD:-180}" "$PY" benchmarks/offload_states.py --device cuda "${GPT[@]}" --stages 0 1 2 3 \
        --rounds 3 --out "$OUT/offload_states.json" ;;
    *) note "unknown step $s" ;;
  esac
done
note "done"
