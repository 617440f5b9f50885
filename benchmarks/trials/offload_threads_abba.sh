#!/usr/bin/env bash
# One device call: 16 host threads (torch's default on a 16-core host) against 15, Mixtral shape at 16 layers, in
# alternating processes after one warm-up process that is not counted (the first process of a call has measured
# slow before, and the earlier 16-layer comparison had 15 first in each call). OMP_WAIT_POLICY=ACTIVE throughout.
# Order: warm-up 16, then 16 15 15 16 15 16. One JSON per counted process and one log under $OUT.
set -u
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=ACTIVE
OUT=${OUT:-/tmp/offload_threads_abba}
mkdir -p "$OUT"
LAYERS=${LAYERS:-16}
i=0
for threads in 16 16 15 15 16 15 16; do
  tag="p${i}_t${threads}"
  dir=/tmp/offload_threads_abba/$tag
  mkdir -p "$dir"
  echo "## $tag (process $i, $threads threads$([ $i = 0 ] && echo ', warm-up: not counted'))"
  python3 benchmarks/offload.py --parts mixtral --mixtral-layers "$LAYERS" --prefetch-rules saving \
    --miss-policies auto --torch-threads "$threads" --time-budget 80 --out "$dir" 2>&1 | grep -v Warning
  [ $i -gt 0 ] && cp "$dir"/offload_*.json "$OUT/$tag.json"
  i=$((i + 1))
done
