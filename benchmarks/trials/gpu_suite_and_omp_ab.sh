#!/usr/bin/env bash
# One device call: the whole GPU suite in one command (pytest-xdist, 8 workers on the one GPU), then the
# Mixtral shape of benchmarks/offload.py (all 32 layers) with the host threads spinning (the benchmark's default,
# OMP_WAIT_POLICY=ACTIVE) and then with libgomp's default (the variable set empty), in that order: the reverse of
# the first call's A/B/A, so a slow first process of the call counts against ACTIVE. Logs and JSONs under $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_suite_out}
mkdir -p "$OUT/active" "$OUT/default"
start=$(date +%s)
timeout "${SUITE_TIMEOUT:-340}" python3 -m pytest -q -m gpu -n "${WORKERS:-8}" -rs --durations=20 -p no:cacheprovider \
  tests/ > "$OUT/gpu_suite.log" 2>&1
echo "suite rc=$? in $(( $(date +%s) - start )) s"
tail -n 45 "$OUT/gpu_suite.log"
run() {  # tag policy
  timeout "${RUN_TIMEOUT:-125}" env OMP_WAIT_POLICY="$2" python3 benchmarks/offload.py --parts mixtral \
    --prefetch-rules saving --time-budget 85 --out "$OUT/$1" > "$OUT/offload_$1.log" 2>&1
  echo "offload $1 (OMP_WAIT_POLICY='$2') rc=$? at $(( $(date +%s) - start )) s"
  grep -E "tok/s|cost model|limits" "$OUT/offload_$1.log"
}
run active ACTIVE
run default ""
