#!/usr/bin/env bash
# The benchmark runner: runs the benchmarks of benchmarks/ on this machine's GPU(s) with jax_megamoe as
# installed (scripts/gpu_check.sh's build step, or scripts/setup_env.sh), and writes each one's log, JSON
# and plot to OUTDIR. What each benchmark measures: benchmarks/README.md.
#
#   bash scripts/bench.sh OUTDIR
#
# Steps (env STEPS, default "moe ep e2e"):
#   moe          benchmarks/bench_moe.py: the MoE layer against the peers, one GPU     -> bench_moe.{log,json,png}
#   decode       benchmarks/bench_moe.py at decode sizes, each row against its floor  -> bench_moe_decode.{log,json,png}
#   generate     benchmarks/bench_generate.py: sampling against transformers' generate -> bench_generate.{log,json}
#   profile-decode  benchmarks/profile_decode.py: one decode step's kernel time by part of the model
#                                                                                        -> profile_decode.{log,json}
#   logprobs     benchmarks/logprob_mismatch.py: sampler against trainer log-probs, by MoE and attention
#                implementation, without and with routing replay                         -> logprob_mismatch.{log,json}
#   ep           benchmarks/bench_ep.py over every GPU of this process (--ep N; with one GPU, ep = 1:
#                the cost of moe_ffn_ep's plumbing)                                      -> bench_ep.{log,json}
#   emulated     benchmarks/bench_ep.py with 8 emulated shards of q30s on one GPU      -> bench_ep_emulated.{log,json}
#   e2e          examples/train_qwen3_moe.py, preset qwen3-30b-a3b-4layer, one GPU     -> e2e.log, e2e_summary.json,
#                                                                                          e2e_loss_curve.png
#   record       benchmarks/train_record.py: the same model trained with our kernels and a pure-JAX
#                baseline, loss curves compared                                          -> train_record.{log,json,png}
#   concurrency  benchmarks/nccl_concurrency.py: moe_ffn_ep beside large NCCL collectives (2+ GPUs)
#                                                                                        -> concurrency.{log,json}
#   profile-ep   benchmarks/profile_ep.py: per-kernel time of one moe_ffn_ep step      -> profile_ep.{log,json}
#   kernels      Nsight Compute per-kernel time and DRAM bytes of one moe_ffn forward+backward
#                (scripts/profile_kernels.py)                                            -> kernels.log
# Arguments per step: MOE_ARGS (default "--configs q30s,q30,q235 --routings uniform,zipf"), DECODE_ARGS (default:
# q30 and q235 at T = 8, 64, 256, 512 against torch and tokamax), GENERATE_ARGS (default: bench_generate's),
# LOGPROBS_ARGS (default "--implementations cuda,reference --attention xla,cudnn"), EP_ARGS
# (default "--config q30"), EMULATED_ARGS (default "--config q30s --emulate 8"), E2E_ARGS (default
# "--steps 100 --batch 4 --seq 4096"), RECORD_ARGS, CONCURRENCY_ARGS, PROFILE_EP_ARGS (default "--config q30"),
# KERNELS_CONFIG (q30s, q30 or q235; default q30), KERNELS_ROUTING (uniform or zipf; default uniform).
# PYTHON (default python3). Exits non-zero if any step failed.
set -uo pipefail
OUTDIR=${1:?usage: scripts/bench.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
STEPS=${STEPS:-"moe ep e2e"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
failed=()
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
(( gpus > 0 )) || gpus=1

source scripts/steps.sh

{
  gpu_record
} | tee "$OUTDIR/gpu.txt"

want moe && step bench-moe bench_moe.log $PY -m benchmarks.bench_moe --json "$OUTDIR/bench_moe.json" \
  --png "$OUTDIR/bench_moe.png" ${MOE_ARGS:---configs q30s,q30,q235 --routings uniform,zipf}

decode_configs=q30-t8,q30-t64,q30-t256,q30-t512,q235-t8,q235-t64,q235-t256,q235-t512
want decode && step bench-moe-decode bench_moe_decode.log $PY -m benchmarks.bench_moe \
  --json "$OUTDIR/bench_moe_decode.json" --png "$OUTDIR/bench_moe_decode.png" \
  ${DECODE_ARGS:---configs $decode_configs --impls ours,torch_grouped_mm,tokamax}

want generate && step bench-generate bench_generate.log $PY -m benchmarks.bench_generate \
  --json "$OUTDIR/bench_generate.json" ${GENERATE_ARGS:-}

want profile-decode && step profile-decode profile_decode.log $PY -m benchmarks.profile_decode \
  --json "$OUTDIR/profile_decode.json" ${PROFILE_DECODE_ARGS:-}

want logprobs && step logprob-mismatch logprob_mismatch.log $PY -m benchmarks.logprob_mismatch \
  --json "$OUTDIR/logprob_mismatch.json" ${LOGPROBS_ARGS:---implementations cuda,reference --attention xla,cudnn}

want ep && step bench-ep bench_ep.log $PY -m benchmarks.bench_ep "$OUTDIR/bench_ep.json" --ep "$gpus" \
  ${EP_ARGS:---config q30}

want emulated && step bench-ep-emulated bench_ep_emulated.log $PY -m benchmarks.bench_ep \
  "$OUTDIR/bench_ep_emulated.json" ${EMULATED_ARGS:---config q30s --emulate 8}

e2e() {
  rm -rf /tmp/jmm_e2e
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} $PY examples/train_qwen3_moe.py --preset qwen3-30b-a3b-4layer \
    --out-dir /tmp/jmm_e2e --no-save-model ${E2E_ARGS:---steps 100 --batch 4 --seq 4096} || return 1
  cp /tmp/jmm_e2e/summary.json "$OUTDIR/e2e_summary.json" && cp /tmp/jmm_e2e/loss_curve.png "$OUTDIR/e2e_loss_curve.png"
}
want e2e && step e2e e2e.log e2e

record() {
  local rc=0
  rm -rf /tmp/jmm_train_record
  $PY -m benchmarks.train_record /tmp/jmm_train_record ${RECORD_ARGS:-} || rc=1
  cp /tmp/jmm_train_record/summary.json "$OUTDIR/train_record.json" 2>/dev/null || rc=1
  cp /tmp/jmm_train_record/loss_curves.png "$OUTDIR/train_record.png" 2>/dev/null || rc=1
  return $rc
}
want record && step train-record train_record.log record

# NCCL's settings are read when JAX starts; NVLink multicast stays off.
want concurrency && step concurrency concurrency.log env NCCL_NVLS_ENABLE=0 $PY -m benchmarks.nccl_concurrency \
  "$OUTDIR/concurrency.json" ${CONCURRENCY_ARGS:-}

profile_ep() {
  rm -rf /tmp/jmm_profile_ep
  $PY -m benchmarks.profile_ep /tmp/jmm_profile_ep --ep "$gpus" ${PROFILE_EP_ARGS:---config q30} &&
    cp /tmp/jmm_profile_ep/profile_ep.json "$OUTDIR/profile_ep.json"
}
want profile-ep && step profile-ep profile_ep.log profile_ep

kernels() {
  local csv=/tmp/jmm_kernels.csv
  ncu --profile-from-start off --clock-control none --csv \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    $PY scripts/profile_kernels.py run "${KERNELS_CONFIG:-q30}" "${KERNELS_ROUTING:-uniform}" > "$csv" || return 1
  $PY scripts/profile_kernels.py summarize "$csv"
}
want kernels && step kernels kernels.log kernels

echo "=== summary: ${#failed[@]} failed step(s): ${failed[*]:-none}"
[[ ${#failed[@]} == 0 ]]
