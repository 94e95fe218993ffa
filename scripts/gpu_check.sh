#!/usr/bin/env bash
# The GPU test run: builds jax_megamoe from source (CUDA kernels included) into the current Python
# environment, runs the GPU tests and a compute-sanitizer memcheck, and writes every log to OUTDIR.
#
#   bash scripts/gpu_check.sh OUTDIR
#
# Steps (env STEPS, default "build test memcheck"; "cputest" adds the CPU suite of the MoE op):
#   build     pip install --no-build-isolation --no-deps -e . (the build requirements must be installed:
#             scikit-build-core, nanobind, jax, nvidia-cutlass, cmake, ninja)          -> build.log
#   test      pytest -m "gpu and not alone" over GPU_TESTS (default tests/), then the tests marked
#             `alone` (they need the GPUs' memory to themselves) one at a time         -> gpu_tests.log
#   memcheck  compute-sanitizer memcheck of scripts/memcheck_cases.py: moe_ffn forward+backward on
#             small bf16 and float32 cases (unaligned sizes, dropped ids) and the nvlink transport
#             with two emulated shards on one GPU                                       -> memcheck.log
#   cputest   the CPU tests of the MoE op (JAX_PLATFORMS=cpu)                          -> cpu_tests.log
# Also writes gpu.txt (GPUs, driver, commit, and the tree hash of the files that ran).
# Options: GPU_TESTS="..." (pytest selection), GPU_TEST_WORKERS=N (pytest-xdist workers sharing the
# GPUs for the non-`alone` tests: their time is mostly XLA compilation), GPU_TEST_TIMEOUT=S (bound on the
# test step, so that the later steps still run), PYTHON (default python3).
# Wheels in .whl/ (for a machine without a package index) are installed first into /tmp/jmm-site, which
# goes on PYTHONPATH. Exits non-zero if any step failed.
set -uo pipefail
OUTDIR=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
STEPS=${STEPS:-"build test memcheck"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
failed=()

source scripts/steps.sh

if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/jmm-site .whl/*.whl
  export PYTHONPATH=/tmp/jmm-site${PYTHONPATH:+:$PYTHONPATH}
fi

{
  gpu_record
  # The tree hash of the files present, through a throw-away index: it names what ran even where the
  # copy's git metadata lags its files (compare with `git rev-parse COMMIT^{tree}`).
  index=$(mktemp -u)
  echo "tree $(GIT_INDEX_FILE=$index git add -A . 2>/dev/null && GIT_INDEX_FILE=$index git write-tree 2>/dev/null)"
  rm -f "$index"
} | tee "$OUTDIR/gpu.txt"

build() {
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} JMM_CUDA=ON
  $PY -m pip install --no-build-isolation --no-deps -e . -v ||
    $PY -m pip install --no-build-isolation --no-deps --break-system-packages -e . -v
}
want build && step build build.log build

gpu_tests() {
  local end=$((SECONDS + ${GPU_TEST_TIMEOUT:-0})) rc=0 code marks limit workers
  for marks in "gpu and not alone" "gpu and alone"; do
    workers=()
    [[ $marks == *"not alone" && -n ${GPU_TEST_WORKERS:-} ]] && workers=(-n "$GPU_TEST_WORKERS")
    limit=0  # timeout's 0: unbounded
    if (( ${GPU_TEST_TIMEOUT:-0} > 0 )); then
      limit=$((end - SECONDS))
      (( limit > 0 )) || { echo "GPU_TEST_TIMEOUT spent before: $marks"; return 124; }
    fi
    # -v names each test as it finishes, so a step cut short still says which passed.
    timeout "$limit" $PY -m pytest -m "$marks" -v -rA --durations=15 -p no:cacheprovider \
      ${workers[@]+"${workers[@]}"} ${GPU_TESTS:-tests/}
    code=$?
    [[ $code == 0 || $code == 5 ]] || rc=$code  # 5: no test of this selection carries these marks
  done
  return $rc
}
want test && step gpu-tests gpu_tests.log gpu_tests

# XLA's GEMM autotuning would run its own candidate kernels under the sanitizer too, which takes minutes
# and checks nothing of ours: off for this step.
want memcheck && step memcheck memcheck.log env XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_autotune_level=0" \
  timeout 900 compute-sanitizer --tool memcheck --error-exitcode 7 --print-limit 20 $PY scripts/memcheck_cases.py

cpu_tests=$(ls tests/test_moe*.py 2>/dev/null | grep -v _gpu || true)
if want cputest && [[ -n $cpu_tests ]]; then
  step cpu-tests cpu_tests.log env JAX_PLATFORMS=cpu $PY -m pytest -q -p no:cacheprovider $cpu_tests
fi

echo "=== summary: ${#failed[@]} failed step(s): ${failed[*]:-none}"
[[ ${#failed[@]} == 0 ]]
