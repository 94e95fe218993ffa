# Sourced by scripts/bench.sh and scripts/gpu_check.sh: their STEPS selection, the step runner and the GPU record.
# The caller sets STEPS and OUTDIR and declares `failed=()`.

want() { [[ " $STEPS " == *" $1 "* ]]; }

step() {  # step NAME LOG CMD...: runs CMD, tees its output into OUTDIR/LOG, records a failure
  local name=$1 log=$2 start=$SECONDS
  shift 2
  echo "=== $name"
  "$@" 2>&1 | tee "$OUTDIR/$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - start)) s"
  [[ $rc == 0 ]] || failed+=("$name")
}

gpu_record() {  # the GPUs, their driver and clocks, and the commit, for OUTDIR/gpu.txt
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv 2>&1
  git log -1 --format='commit %H %cd' 2>/dev/null
}
