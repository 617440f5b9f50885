#!/usr/bin/env bash
# One device call on a single H100: the routing and EP row kernels on the GPU (their tests at full shapes,
# the interpreter tests run on CUDA), then the routing benchmark (route_rows_triton with PDL and the
# kept-zero group counts, without PDL, and the previous memset path, in one run) and the per-launch
# times. Results and logs under $OUT (at most 8 files come back).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/routing_gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
export GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
start=$(date +%s)
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/test_routing_fused.py tests/test_routing_gate.py tests/test_permute.py tests/test_capacity.py \
  tests/test_ep_row_kernels.py > "$OUT/routing_gpu_tests.log" 2>&1
echo "tests rc=$? in $(( $(date +%s) - start )) s"; tail -n 3 "$OUT/routing_gpu_tests.log"
start=$(date +%s)
timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/routing.py --out "$OUT" > "$OUT/routing.log" 2>&1
echo "routing rc=$? in $(( $(date +%s) - start )) s"; tail -n 24 "$OUT/routing.log"
timeout "${LAUNCH_TIMEOUT:-120}" python3 benchmarks/routing_launches.py --quick --out "$OUT" > "$OUT/routing_launches.log" 2>&1
echo "launches rc=$?"; grep -E "E256.*T= 8192" "$OUT/routing_launches.log"
