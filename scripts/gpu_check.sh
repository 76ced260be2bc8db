#!/usr/bin/env bash
# One GPU session's checks, each step with its own time limit, results written as they come (a step that
# times out or fails does not stop the next). Run on a lent GPU machine from the checkout:
#   OUT=/some/dir bash scripts/gpu_check.sh [steps...]       # default: build env tests step offload
# Every file goes to $OUT/work/; after each step $OUT/results.tgz is made anew from it (the device tool
# brings back at most 8 files), and $OUT/summary.txt says what each step did.
# Steps:
#   build    TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace (the checkout's zerocore/ gets _C*.so)
#   env      zerocore env (what was built, with which compiler)
#   tests    the GPU tests, one file per process, a crash named (scripts/gpu_tests.py)
#   step     benchmarks/step.py --device cuda: torch AMP and zerocore stages 0-3 on the 337M GPT, memory net of
#            each variant's baseline, left after del / after gc
#   offload  benchmarks/offload_states.py on the same GPT: device memory freed, round trip vs the pinned copy rate
#   cpuoffload  step.py on the same GPT with CPU offload at stages 2 and 3 beside the same stages without it
#            (T_device) and DeepSpeed's (when installed): T_host and each step against max(T_device, T_host);
#            2 steps of each profiled (where the step's time goes)
#   llama    step.py on the Hugging Face Llama of issue 35 (256M, 16 layers, 4 x 512 tokens): torch AMP, stages 2, 3,
#            and both without bf16's per-step Inf/NaN read (bf16.check_grad_overflow: false); interleaved, profiled
#   compile  benchmarks/compile_stage3.py --device cuda: engine.compile() against eager at stages 2 and 3
#   dsjit    (in the background) DeepSpeed's CPU Adam and fused Adam JIT-built, so that cpuoffload's DeepSpeed rows
#            time steps, not nvcc; cpuoffload waits for it
#   hostadam benchmarks/fused_adam.py on the host (300M, bf16-mixed, cold, every core but one): the host Adam in and
#            out of place against the host's memory roofline
#   kernels  benchmarks/gpu_proof.py --steps bench: Adam, cast, pack/unpack, sum of squares beside torch and copy
#   variants benchmarks/cuda_variants.py: the cast and Adam kernels' device time beside other launch layouts
#   hostbatch  benchmarks/offload_host_batch.py on a 337M GPT: stage 2 + CPU offload's engine.step() with each
#            group's host step handed over on its own against consecutive groups as one job (the default)
#   hostthreads  benchmarks/offload_speculation.py at ctx 128, stage 2, once per host thread count (HOST_THREADS_LIST)
#   speculation  benchmarks/offload_speculation.py on the same GPT: stage 2 + CPU offload with the host Adam started
#            during the backward (offload_optimizer.speculative_step; kept, and always dropped) against the step as
#            before, beside T_device and T_host; speculation3: the same at stage 3; SPECULATION_EXTRA: more arguments
#   landtime benchmarks/land_host_time.py --device cuda: the host time of each operation of the offload's gradient
#            landing on a busy device, and of each line of HostSteppedShard.land in a stage-2 + offload backward
# Python packages the image lacks (DeepSpeed and its pydantic, hjson) travel as wheels in .whl/ (carry it):
# installed into /tmp/site first (once per machine: a later call on the warm machine skips it). Made here
# with `echo /.whl/ >> .git/info/exclude` and, for each of
# deepspeed==0.19.8 pydantic pydantic_core annotated-types typing-inspection hjson (the versions pydantic pins):
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl NAME
# (DeepSpeed's own wheel: `DS_BUILD_OPS=0 pip wheel --no-deps deepspeed==0.19.8`, a py3-none-any build.)
# Environment: PY (default python3), ZC_ARCH (default 9.0); step limits in seconds T_BUILD, T_TESTS, T_STEP,
# T_OFFLOAD, T_CPUOFFLOAD, T_LLAMA, T_COMPILE, T_KERNELS, T_VARIANTS, T_HOSTBATCH, T_SPECULATION, T_HOSTADAM, T_LANDTIME, T_HOSTTHREADS; B_TESTS (the tests' budget), GPU_TEST_FILES,
# LLAMA_ROUNDS, KERNEL_ROUNDS, COMPILE_ROUNDS, COMPILE_STEPS, CPUOFFLOAD_VARIANTS, CPUOFFLOAD_PROFILE, SPECULATION_EXTRA, SPECULATION_PROFILE, HOST_THREADS_LIST.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder for the results}
PY=${PY:-python3}
W="$OUT/work"
mkdir -p "$W"
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(build env tests step offload)
if compgen -G ".whl/*.whl" >/dev/null; then
  # a later call on the same (warm) machine finds them installed: no second install of its device time
  if [ -f /tmp/site/.zc_wheels ] && cmp -s /tmp/site/.zc_wheels <(ls .whl); then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  elif "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    ls .whl > /tmp/site/.zc_wheels
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: the wheels in .whl did not install" >&2
  fi
fi
# one arch for zerocore's build and DeepSpeed's JIT ops (its cache key includes the flags)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCH_CUDA_ARCH_LIST="${ZC_ARCH:-9.0}"
DSJIT_PID=
summary="$OUT/summary.txt"
note() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$summary"; }
pack() { cp "$summary" "$W/" 2>/dev/null; tar czf "$OUT/results.tgz.tmp" -C "$W" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"; }
run() {  # run NAME SECONDS CMD...: output to $W/NAME.log, status and time to the summary
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$W/$name.log" 2>&1
  local rc=$?
  note "$name: rc=$rc in $((SECONDS - t0)) s (limit $limit)$([ $rc = 124 ] && echo ' TIMED OUT')"
  tail -n 25 "$W/$name.log"
  pack
  return 0
}
GPT=(--vocab 32768 --dim 1024 --layers 24 --heads 16 --ctx 1024 --batch 8)
note "machine: $(nvidia-smi -L 2>/dev/null | head -1); $($PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__)')"
for s in "${steps[@]}"; do
  case $s in
    build)  # in place: the checkout's zerocore/ gets _C*.so (PYTHONPATH points here)
      run build "${T_BUILD:-240}" env TORCH_CUDA_ARCH_LIST="${ZC_ARCH:-9.0}" MAX_JOBS=16 \
        "$PY" setup.py build_ext --inplace ;;
    env)
      run env 60 "$PY" -m zerocore env ;;
    tests)
      # GPU_TEST_FILES: the files (in this order) instead of all of tests/
      run tests "${T_TESTS:-220}" "$PY" scripts/gpu_tests.py --out "$W/gpu_tests.json" --timeout 120 --reruns 1 \
        --budget "${B_TESTS:-190}" ${GPU_TEST_FILES:-} ;;
    step)
      run step "${T_STEP:-150}" "$PY" benchmarks/step.py --device cuda --ranks 1 "${GPT[@]}" --steps 5 --rounds 2 \
        --warmup 2 --variants torch_amp zerocore_stage0 zerocore_stage1 zerocore_stage2 zerocore_stage3 \
        --out "$W/step_gpt337M.json" ;;
    offload)
      run offload "${T_OFFLOAD:-120}" "$PY" benchmarks/offload_states.py --device cuda "${GPT[@]}" --stages 0 1 2 3 \
        --rounds 3 --out "$W/offload_states.json" ;;
    dsjit)
      ( timeout 300 "$PY" -c "from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
CPUAdamBuilder().load(); FusedAdamBuilder().load(); print('DeepSpeed ops built')" >"$W/dsjit.log" 2>&1
        note "dsjit: rc=$? (background)" ) &
      DSJIT_PID=$! ;;
    variants)  # device time of the cast and Adam kernels beside other launch layouts (csrc/bench/cuda_variants.cu)
      run variants "${T_VARIANTS:-120}" "$PY" benchmarks/cuda_variants.py --rounds 20 --out "$W/cuda_variants.json" ;;
    hostbatch)  # stage 2 + CPU offload: engine.step() with each group's host step on its own vs batched
      run hostbatch "${T_HOSTBATCH:-150}" "$PY" benchmarks/offload_host_batch.py --device cuda --dim 1024 --layers 24 \
        --heads 16 --ctx 128 --batch 8 --vocab 8192 --bucket 2.5e6 --threads "$(( $(nproc) - 1 ))" --rounds 8 \
        --steps 3 --out "$W/offload_host_batch.json" ;;
    speculation|speculation3)  # stage 2 (3) + CPU offload: the host Adam during the backward (kept / dropped) vs after it
      stage=2; [ $s = speculation3 ] && stage=3
      # SPECULATION_EXTRA: more arguments (later ones win), e.g. "--trace --rounds 3 --variants after_backward speculative";
      # SPECULATION_PROFILE=1: 2 steps of each variant profiled (the copies' device time and rate beside the host Adam)
      prof=(); [ "${SPECULATION_PROFILE:-0}" = 1 ] && prof=(--profile "$W/profile_$s")
      run $s "${T_SPECULATION:-150}" "$PY" benchmarks/offload_speculation.py --device cuda --dim 1024 \
        --layers 24 --heads 16 --ctx 128 --batch 8 --vocab 8192 --bucket 2.5e6 --threads "$(( $(nproc) - 1 ))" \
        --rounds 5 --steps 3 --stage $stage ${SPECULATION_EXTRA:-} "${prof[@]}" --out "$W/offload_$s.json" ;;
    hostthreads)  # the host step's thread count: T_host and the stage-2 offload step at ctx 128 (host-bound), each
      # count in its own run (HOST_THREADS_LIST, default every core but 1, every core but 4, and 8): where the host
      # Adam stops gaining from threads (memory bandwidth) while the backward's host work competes for the cores
      for n in ${HOST_THREADS_LIST:-$(( $(nproc) - 1 )) $(( $(nproc) - 4 )) 8}; do
        run hostthreads_$n "${T_HOSTTHREADS:-60}" "$PY" benchmarks/offload_speculation.py --device cuda --dim 1024 \
          --layers 24 --heads 16 --ctx 128 --batch 8 --vocab 8192 --bucket 2.5e6 --threads "$n" --rounds 3 --steps 3 \
          --stage 2 --variants no_offload after_backward speculative --out "$W/offload_threads_$n.json"
      done ;;
    landtime)  # where the host time of the offload's gradient landing goes (per operation, per line)
      run landtime "${T_LANDTIME:-90}" "$PY" benchmarks/land_host_time.py --device cuda --out "$W/land_host_time.json" ;;
    hostadam)  # the host Adam against this host's memory roofline (T_host's floor), in and out of place
      run hostadam "${T_HOSTADAM:-120}" env OMP_NUM_THREADS="$(( $(nproc) - 1 ))" "$PY" benchmarks/fused_adam.py \
        --sizes 3e8 --layouts flat,tensors --precisions mixed --protocols cold --reps 5 --no-deepspeed \
        --out "$W/fused_adam_host.json" ;;
    kernels)
      run kernels "${T_KERNELS:-120}" "$PY" benchmarks/gpu_proof.py --steps bench --rounds "${KERNEL_ROUNDS:-10}" \
        --out-dir "$W" ;;
    cpuoffload)
      [ -n "$DSJIT_PID" ] && wait "$DSJIT_PID"
      # CPUOFFLOAD_VARIANTS: these variants instead of the preset's; CPUOFFLOAD_PROFILE=0: no profiled steps
      which=(--preset offload)
      [ -n "${CPUOFFLOAD_VARIANTS:-}" ] && which=(--variants $CPUOFFLOAD_VARIANTS)
      prof=(--profile "$W/profile_offload" --profile-steps 2)
      [ "${CPUOFFLOAD_PROFILE:-1}" = 0 ] && prof=()
      run cpuoffload "${T_CPUOFFLOAD:-300}" "$PY" benchmarks/step.py --device cuda --ranks 1 "${GPT[@]}" --steps 4 \
        --rounds 2 --warmup 2 "${which[@]}" "${prof[@]}" --out "$W/step_offload.json" ;;
    llama)  # a short, host-bound step: variants alive at once, rounds interleaved
      run llama "${T_LLAMA:-150}" "$PY" benchmarks/step.py --device cuda --ranks 1 --model hf-llama --dim 1024 \
        --layers 16 --ctx 512 --batch 4 --steps 5 --rounds "${LLAMA_ROUNDS:-8}" --warmup 3 --interleave \
        --variants torch_amp zerocore_stage2 zerocore_stage3 zerocore_stage2_no_nan_check \
        zerocore_stage3_no_nan_check --profile "$W/profile" --profile-steps 2 --out "$W/step_llama.json" ;;
    compile)
      run compile "${T_COMPILE:-240}" "$PY" benchmarks/compile_stage3.py --device cuda --vocab 8192 --dim 512 \
        --layers 8 --ctx 256 --batch 8 --rounds "${COMPILE_ROUNDS:-3}" --steps "${COMPILE_STEPS:-16}" --variants stage2_eager stage2_compiled stage3_eager \
        stage3_compiled stage3_compiled_checks --out "$W/compile_stage3.json" ;;
    *) note "unknown step $s" ;;
  esac
done
note "done"
pack
