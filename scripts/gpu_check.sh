#!/usr/bin/env bash
# The GPU check harness: build jax_megamoe from source (CUDA kernels included), run the GPU tests, a
# compute-sanitizer memcheck of the CUDA op on small cases, the CPU MoE tests, the layer benchmark, the
# expert-parallel overhead benchmark and the training record; on machines with 2+ GPUs, the multi-GPU
# steps (not in the default STEPS): moe_ffn_ep across two jax.distributed processes, the NCCL-concurrency
# deadlock test and the EP=2 backend comparison.
# Works offline (no package registry needed) when the build requirements are installed; the wheels of
# nvidia-cutlass (and pytest-xdist, execnet) found in .whl/ are installed into /tmp/site first (the H200
# machine has none), those in .whl/peers/ (tokamax and its dependencies) into /tmp/site-peers for the bench.
#
# Usage: scripts/gpu_check.sh OUTDIR
#   env STEPS="build test memcheck cputest profile bench epbench emubench trainrecord" (the default), and
#             "arrivalbench" (the arrival-gated GEMM beside a row transfer, ARRIVAL_BENCH_ARGS="copy kernel blocks...",
#             and the stage-2 forward's front half, STAGE2_BENCH_ARGS="side gather blocks..."),
#             multi-GPU steps, named explicitly: "mpgpu concurrency ep2bench ep2profile",
#       GPU_TESTS="..." (pytest selection, default: tests/ — every test marked gpu), GPU_TEST_WORKERS=N,
#       GPU_TEST_TIMEOUT=S (seconds for the test step, default unbounded),
#       BENCH_ARGS="..." (passed to benchmarks/bench_moe.py), PROFILE_CONFIG=q30s|q30|q235 (default q30),
#       PROFILE_ROUTING=uniform|zipf (default uniform),
#       TRAIN_RECORD_ARGS="..." (passed to benchmarks/train_record.py), TRAIN_RECORD_TIMEOUT=seconds,
#       CONCURRENCY_ARGS="..." (passed to benchmarks/nccl_concurrency.py, e.g. "--iters 200 --backend xla"),
#       CONCURRENCY_CTAS="unset 32" (one concurrency run per NCCL_MAX_CTAS value; "unset" leaves it unset),
#       EP2BENCH_ARGS="..." (passed to benchmarks/bench_ep.py in ep2bench),
#       EP2PROFILE_ARGS="..." (passed to benchmarks/profile_ep.py in ep2profile, e.g. "--iters 3")
# Writes gpu.txt, build.log, gpu_tests.log, memcheck.log, cpu_tests.log, profile.log (ncu per-kernel
# times), bench.log, bench.json, bench.png, bench_ep.{log,json}, bench_ep_emulated.{log,json}, train_record.{log,json,png},
# mp_gpu_tests.log, concurrency.{log,json} (all runs in one of each), bench_ep2.{log,json},
# profile_ep2.{log,json}, arrival_bench.log into OUTDIR
# (the device tool returns at most 8 files: choose STEPS accordingly); exits non-zero if any step failed.
set -uo pipefail
OUTDIR=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUTDIR"
cd "$(dirname "$0")/.."
STEPS=${STEPS:-"build test memcheck cputest profile bench epbench emubench trainrecord"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
failed=()

want() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME LOG CMD...: runs CMD, tees its output into LOG, records failure
  local name=$1 log=$2; shift 2
  echo "=== $name ($(date -u +%FT%TZ))"
  local start=$SECONDS
  "$@" 2>&1 | tee "$OUTDIR/$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - start)) s"
  [[ $rc == 0 ]] || failed+=("$name")
}

if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Peers' packages (tokamax and what it needs) go to a folder of their own that only the bench's tokamax
# child appends to its path, so they can never shadow the image's packages.
if compgen -G ".whl/peers/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site-peers .whl/peers/*.whl
  export JMM_PEER_SITE=/tmp/site-peers
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv 2>&1 | tee "$OUTDIR/gpu.txt"
git log -1 --format='commit %H %cd' 2>/dev/null | tee -a "$OUTDIR/gpu.txt"
# The device copy's git metadata can be older than its files: the tree hash of the files actually here (through
# a throw-away index) names what ran; compare it with `git rev-parse <commit>^{tree}`. .devrun (scripts carried
# to the device, ignored only through .git/info/exclude here) is left out.
tree_index=$(mktemp -u)
echo "tree $(GIT_INDEX_FILE=$tree_index git add -A . 2>/dev/null &&
             GIT_INDEX_FILE=$tree_index git rm -r -q --cached --ignore-unmatch .devrun 2>/dev/null &&
             GIT_INDEX_FILE=$tree_index git write-tree 2>/dev/null)" |
  tee -a "$OUTDIR/gpu.txt"
rm -f "$tree_index"

build() {
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  $PY -m pip install --no-build-isolation --no-deps -e . -v ||
    $PY -m pip install --no-build-isolation --no-deps --break-system-packages -e . -v
}
want build && step build build.log build

# GPU_TEST_WORKERS=N runs the GPU tests in N pytest-xdist processes sharing the GPU(s): their time is
# mostly XLA compilation, which then runs on N cores (pytest-xdist and execnet come as wheels in .whl/).
# Tests marked `alone` (large models) run afterwards, one at a time. -v names each test as it finishes, so
# a step cut short still says which passed; GPU_TEST_TIMEOUT=S bounds the step (0, the default: unbounded)
# so that the steps after it still run.
gpu_tests() {
  local end=$((SECONDS + ${GPU_TEST_TIMEOUT:-0})) rc=0 code marks workers
  for marks in "gpu and not alone" "gpu and alone"; do
    workers=()
    [[ $marks == *"not alone" && -n ${GPU_TEST_WORKERS:-} ]] && workers=(-n "$GPU_TEST_WORKERS")
    local limit=0  # timeout's 0: unbounded
    if (( ${GPU_TEST_TIMEOUT:-0} > 0 )); then
      limit=$((end - SECONDS))
      (( limit > 0 )) || { echo "GPU_TEST_TIMEOUT spent before: $marks"; return 124; }
    fi
    timeout "$limit" $PY -m pytest -m "$marks" -v -rA --durations=15 -p no:cacheprovider \
      ${workers[@]+"${workers[@]}"} \
      ${GPU_TESTS:-tests/}
    code=$?
    [[ $code == 0 || $code == 5 ]] || rc=$code  # 5: the selection has no such test
  done
  return $rc
}
want test && step gpu-tests gpu_tests.log gpu_tests

cat > /tmp/jmm_memcheck.py <<'PYEOF'
import jax, jax.numpy as jnp, numpy as np
import jax_megamoe as jmm
for (t, h, i, e, k, dtype) in [(37, 64, 32, 5, 2, jnp.bfloat16), (19, 20, 12, 3, 3, jnp.float32),
                               (40, 24, 16, 4, 2, jnp.bfloat16)]:
    ks = jax.random.split(jax.random.PRNGKey(t), 4)
    x = jax.random.normal(ks[0], (t, h)).astype(dtype)
    experts = jax.random.randint(ks[1], (t, k), -1, e + 1)  # includes dropped ids
    weights = jax.random.uniform(ks[2], (t, k))
    wgu = (jax.random.normal(ks[3], (e, h, 2 * i)) * 0.1).astype(dtype)
    wd = (jax.random.normal(ks[3], (e, i, h)) * 0.1).astype(dtype)
    f = lambda x, w, g, d: jmm.moe_ffn(x, w, experts, g, d, backend="cuda").astype(jnp.float32).sum()
    val, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, weights, wgu, wd)
    assert all(np.isfinite(np.asarray(v, np.float32)).all() for v in (val, *grads))
    print("memcheck case", (t, h, i, e, k, jnp.dtype(dtype).name), "ok")
# The nvlink transport with two emulated shards on this GPU: forward and backward through the workspace.
import functools
R, T, H, I, E, K = 2, 24, 40, 16, 8, 2
ks = jax.random.split(jax.random.PRNGKey(1), 5)
ids = jax.random.randint(ks[0], (R, T, K), 0, E)
w = jax.random.uniform(ks[1], (R, T, K))
x = jax.random.normal(ks[2], (R, T, H), jnp.bfloat16)
gu = (jax.random.normal(ks[3], (R, E // R, H, 2 * I)) * 0.1).astype(jnp.bfloat16)
d = (jax.random.normal(ks[4], (R, E // R, I, H)) * 0.1).astype(jnp.bfloat16)
with jmm.NvlinkWorkspace.emulated(R, max_tokens=T, hidden=H, top_k=K) as ws:
    ep = jax.vmap(functools.partial(jmm.moe_ffn_ep, backend="nvlink", workspace=ws), axis_name="expert")
    f = lambda x, w, g, d: ep(x, w, ids, g, d).astype(jnp.float32).sum()
    val, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, w, gu, d)
    assert all(np.isfinite(np.asarray(v, np.float32)).all() for v in (val, *grads))
print("memcheck case nvlink emulated R=2 ok")
PYEOF
# XLA's GEMM autotuning would run its candidate kernels under the sanitizer too (the nvlink case's compile
# outlasted the step on 2026-11-30): off, since the check is of our kernels, not of XLA's choice among its own.
want memcheck && step memcheck memcheck.log env XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_autotune_level=0" \
  timeout 420 compute-sanitizer --tool memcheck --error-exitcode 7 --print-limit 20 $PY /tmp/jmm_memcheck.py

cpu_tests=$(ls tests/test_moe*.py 2>/dev/null | grep -v _gpu || true)
if want cputest && [[ -n $cpu_tests ]]; then
  step cpu-tests cpu_tests.log env JAX_PLATFORMS=cpu $PY -m pytest -q -p no:cacheprovider $cpu_tests
fi

# Per-kernel device time and DRAM bytes of one forward+backward (bf16) at PROFILE_CONFIG and PROFILE_ROUTING
# (q30s, q30 or q235; default q30), read by Nsight Compute.
cat > /tmp/jmm_profile.py <<'PYEOF'
import math, sys, jax, jax.numpy as jnp, torch
import jax_megamoe as jmm
t, h, i, e, k = {"q30s": (2048, 2048, 768, 128, 8), "q30": (16384, 2048, 768, 128, 8),
                 "q235": (16384, 4096, 1536, 128, 8)}[sys.argv[1]]
ks = jax.random.split(jax.random.PRNGKey(0), 6)
x = jax.random.normal(ks[0], (t, h), jnp.bfloat16)
gu = (jax.random.normal(ks[1], (e, h, 2 * i)) / math.sqrt(h)).astype(jnp.bfloat16)
d = (jax.random.normal(ks[2], (e, i, h)) / math.sqrt(i)).astype(jnp.bfloat16)
dy = jax.random.normal(ks[3], (t, h), jnp.bfloat16)
log_p = jnp.zeros(e) if sys.argv[2] == "uniform" else -1.2 * jnp.log1p(jnp.arange(e))  # as bench_moe.py
ids = jax.lax.top_k(log_p + jax.random.gumbel(ks[4], (t, e)), k)[1].astype(jnp.int32)
w = jax.nn.softmax(jax.random.normal(ks[5], (t, k)), axis=-1)
f = jax.jit(lambda *a: jax.vjp(lambda x, w, gu, d: jmm.moe_ffn(x, w, ids, gu, d, backend="cuda"), *a[:4])[1](a[4]))
for _ in range(2):
    jax.block_until_ready(f(x, w, gu, d, dy))
torch.cuda.profiler.start()
jax.block_until_ready(f(x, w, gu, d, dy))
torch.cuda.profiler.stop()
PYEOF
profile() {
  local config=${PROFILE_CONFIG:-q30} routing=${PROFILE_ROUTING:-uniform}
  ncu --profile-from-start off --clock-control none --csv \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    $PY /tmp/jmm_profile.py "$config" "$routing" > "/tmp/jmm_ncu_$config.csv" || return 1
  echo "config $config, $routing routing: per kernel, in launch order"
  $PY - "/tmp/jmm_ncu_$config.csv" <<'PYEOF'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, body = rows[0], rows[1:]
col = {c: head.index(c) for c in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
         "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}  # to us and MB
kernels = {}  # ID -> name and metrics, in launch order
for r in body:
    entry = kernels.setdefault(r[col["ID"]], {"name": r[col["Kernel Name"]]})
    entry[r[col["Metric Name"]]] = float(r[col["Metric Value"]].replace(",", "")) * scale[r[col["Metric Unit"]]]
total = [0.0, 0.0, 0.0]
print(f"{'time us':>10} {'read MB':>9} {'write MB':>9}  kernel")
for m in kernels.values():
    vals = [m.get("gpu__time_duration.sum", 0.0), m.get("dram__bytes_read.sum", 0.0), m.get("dram__bytes_write.sum", 0.0)]
    total = [a + b for a, b in zip(total, vals)]
    print(f"{vals[0]:10.1f} {vals[1]:9.1f} {vals[2]:9.1f}  {m['name'][:100]}")
print(f"{total[0]:10.1f} {total[1]:9.1f} {total[2]:9.1f}  total of {len(kernels)} kernels")
PYEOF
}
want profile && step profile profile.log profile

want bench && step bench bench.log $PY benchmarks/bench_moe.py --json "$OUTDIR/bench.json" \
  --png "$OUTDIR/bench.png" ${BENCH_ARGS:-}

want epbench && step bench-ep bench_ep.log $PY benchmarks/bench_ep.py "$OUTDIR/bench_ep.json" --config q30
# 8 emulated shards of q30s on this GPU (q30's total work): the cost of the transports' protocols themselves.
want emubench && step bench-ep-emulated bench_ep_emulated.log $PY benchmarks/bench_ep.py \
  "$OUTDIR/bench_ep_emulated.json" --config q30s --emulate 8 --backend xla,nvlink,nvlink_stage1

train_record() {
  local rc=0
  rm -rf /tmp/jmm_train_record  # nothing stale from an earlier record may be copied back
  # TRAIN_RECORD_TIMEOUT (seconds) stops the record in time to bring back what the runs wrote so far.
  timeout "${TRAIN_RECORD_TIMEOUT:-86400}" $PY benchmarks/train_record.py /tmp/jmm_train_record \
    ${TRAIN_RECORD_ARGS:-} || rc=1
  # Every run's per-step metrics and summary, also of a run cut short, in one file (8 files come back).
  tail -n +1 /tmp/jmm_train_record/*/metrics.jsonl /tmp/jmm_train_record/*/summary.json \
    > "$OUTDIR/train_record_runs.txt" 2>/dev/null
  cp /tmp/jmm_train_record/summary.json "$OUTDIR/train_record.json" 2>/dev/null || rc=1
  cp /tmp/jmm_train_record/loss_curves.png "$OUTDIR/train_record.png" 2>/dev/null || rc=1
  return $rc
}
want trainrecord && step train-record train_record.log train_record

# Builds cuda/tests/$1.cu (a standalone program against the installed CUTLASS headers) into /tmp/jmm_$1.
build_cuda_program() {
  local include
  include=$($PY -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))") || return 1
  nvcc -std=c++17 --expt-relaxed-constexpr -arch=sm_90a -O3 -DNDEBUG -Icuda/include "-I$include" \
    "cuda/tests/$1.cu" -o "/tmp/jmm_$1"
}

# The arrival-gated GEMM beside a row transfer (cuda/tests/arrival_gemm_bench.cu; nvlink stage 2): how much of it
# the overlap hides, by copy engine and by copy kernels, both group orders; then the front half of the stage-2
# forward against the stage-1 order (cuda/tests/stage2_forward_bench.cu). Over NVLink from GPU 1 where there are
# two GPUs. Not in the default steps.
arrival_bench() {
  build_cuda_program arrival_gemm_bench && build_cuda_program stage2_forward_bench || return 1
  /tmp/jmm_arrival_gemm_bench ${ARRIVAL_BENCH_ARGS:-} && /tmp/jmm_stage2_forward_bench ${STAGE2_BENCH_ARGS:-}
}
want arrivalbench && step arrival-bench arrival_bench.log arrival_bench

# Multi-GPU steps. moe_ffn_ep across two jax.distributed processes, one GPU each (xla and ragged over NCCL).
want mpgpu && step mp-gpu-tests mp_gpu_tests.log $PY -m pytest -m gpu -q -rA -p no:cacheprovider \
  tests/test_ep_multiprocess_gpu.py

# The deadlock test: MoE fwd+bwd with large FSDP collectives in one step, once per NCCL_MAX_CTAS value;
# every run's JSON is merged into concurrency.json (keyed by the NCCL_MAX_CTAS value).
concurrency() {
  local rc=0 ctas runs=()
  for ctas in ${CONCURRENCY_CTAS:-unset 32}; do
    local flags=()
    [[ $ctas == unset ]] || flags=(--nccl-max-ctas "$ctas")
    echo "--- nccl_concurrency.py, NCCL_MAX_CTAS=$ctas"
    rm -f "/tmp/jmm_concurrency_$ctas.json"
    env -u NCCL_MAX_CTAS NCCL_NVLS_ENABLE=0 $PY benchmarks/nccl_concurrency.py "/tmp/jmm_concurrency_$ctas.json" \
      ${flags[@]+"${flags[@]}"} ${CONCURRENCY_ARGS:-} || rc=1
    runs+=("$ctas=/tmp/jmm_concurrency_$ctas.json")
  done
  $PY - "$OUTDIR/concurrency.json" "${runs[@]}" <<'PYEOF' || rc=1
import json, os, sys
merged = {}
for run in sys.argv[2:]:
    ctas, path = run.split("=", 1)
    merged[f"NCCL_MAX_CTAS={ctas}"] = json.load(open(path)) if os.path.exists(path) else {"error": "no JSON written"}
json.dump(merged, open(sys.argv[1], "w"), indent=2)
print("wrote", sys.argv[1], {k: (v.get("iterations_done"), v.get("hangs"), v.get("ok")) for k, v in merged.items()})
PYEOF
  return $rc
}
want concurrency && step concurrency concurrency.log concurrency

want ep2bench && step bench-ep2 bench_ep2.log $PY benchmarks/bench_ep.py "$OUTDIR/bench_ep2.json" --ep 2 \
  --backend xla,nvlink,nvlink_stage1 --config q30 ${EP2BENCH_ARGS:-}

# Per-kernel time of one EP = 2 forward+backward step on each GPU (JAX profiler trace; the traces stay in
# /tmp, only the summaries come back in one JSON).
ep2profile() {
  local rc=0 backend
  for backend in xla nvlink; do
    rm -rf "/tmp/jmm_profile_ep_$backend"
    $PY benchmarks/profile_ep.py "/tmp/jmm_profile_ep_$backend" --ep 2 --backend $backend --config q30 \
      ${EP2PROFILE_ARGS:-} || rc=1
  done
  $PY - "$OUTDIR/profile_ep2.json" /tmp/jmm_profile_ep_xla/profile_ep.json /tmp/jmm_profile_ep_nvlink/profile_ep.json \
    <<'PYEOF' || rc=1
import json, os, sys
json.dump([json.load(open(p)) for p in sys.argv[2:] if os.path.exists(p)], open(sys.argv[1], "w"), indent=1)
PYEOF
  return $rc
}
want ep2profile && step profile-ep2 profile_ep2.log ep2profile

echo "=== summary: ${#failed[@]} failed step(s): ${failed[*]:-none}"
[[ ${#failed[@]} == 0 ]]
