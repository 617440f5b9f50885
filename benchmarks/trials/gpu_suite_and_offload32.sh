#!/usr/bin/env bash
# One device call: the whole GPU suite in one command (pytest-xdist, 8 workers on the one GPU; it also serves as the
# call's warm-up), then the Mixtral shape of benchmarks/offload.py at all 32 layers with the engine's defaults (the
# host threads spinning on cores - 1), twice. Logs and JSONs under $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_suite_out}
mkdir -p "$OUT"
start=$(date +%s)
timeout "${SUITE_TIMEOUT:-300}" python3 -m pytest -q -m gpu -n "${WORKERS:-8}" -rs --durations=15 -p no:cacheprovider \
  tests/ > "$OUT/gpu_suite.log" 2>&1
echo "suite rc=$? in $(( $(date +%s) - start )) s"
tail -n 30 "$OUT/gpu_suite.log"
for tag in a b; do
  mkdir -p "/tmp/offload32/$tag"
  timeout "${RUN_TIMEOUT:-140}" python3 benchmarks/offload.py --parts mixtral --prefetch-rules saving \
    --time-budget 100 --out "/tmp/offload32/$tag" > "$OUT/offload32_$tag.log" 2>&1
  echo "offload $tag rc=$? at $(( $(date +%s) - start )) s"
  cp /tmp/offload32/$tag/offload_*.json "$OUT/offload32_$tag.json" 2>/dev/null
  grep -E "tok/s|cost model|limits" "$OUT/offload32_$tag.log" | cut -c1-250
done
