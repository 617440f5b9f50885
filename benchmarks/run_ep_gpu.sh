#!/usr/bin/env bash
# One device call on a multi-GPU H200 kind: NCCL equality tests (layer + engine, bf16; 2 ranks, and 4
# where 4 GPUs exist), then the EP benchmark: EP=1 and EP=2 (and EP=4 on 4 GPUs). Results, logs under $OUT
# (at most 7 files). NVLink multicast stays off (KINDS.md). TEST_K: pytest -k filter (e.g. "4" for the
# 4-rank tests only); ONLY_EP4=1: on 4 GPUs skip the EP=1 and EP=2 benchmarks.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ep_gpu_out}
mkdir -p "$OUT"
ITERS=${ITERS:-20}
NG=$(python3 -c 'import torch; print(torch.cuda.device_count())')
TAG=${NG}xh200
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
start=$(date +%s)
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu tests/test_ep_gpu.py -k "${TEST_K:-nccl}" -p no:cacheprovider -rA \
  > "$OUT/ep_gpu_tests_$TAG.log" 2>&1
echo "tests rc=$? in $(( $(date +%s) - start )) s"
grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FAIL rank|EP LAYER OK|worst_rel_err" "$OUT/ep_gpu_tests_$TAG.log" | tail -14
bench() {  # nproc gpus tag
  CUDA_VISIBLE_DEVICES=$2 timeout "${BENCH_TIMEOUT:-200}" torchrun --standalone --nproc-per-node "$1" \
    benchmarks/expert_parallel.py --iters "$ITERS" --out "$OUT/expert_parallel_$3.json" > "$OUT/expert_parallel_$3.log" 2>&1
  echo "bench ep=$1 rc=$?"
}
start=$(date +%s)
if [ "$NG" -ge 4 ]; then
  [ "${ONLY_EP4:-0}" = 1 ] || { bench 2 0,1 "${TAG}_ep2" & bench 1 2 "${TAG}_ep1" & wait; }
  bench 4 0,1,2,3 "${TAG}_ep4"
else
  bench 2 0,1 "${TAG}_ep2"
  [ "${SKIP_EP1:-0}" = 1 ] || BENCH_TIMEOUT=${EP1_TIMEOUT:-90} bench 1 0 "${TAG}_ep1"
fi
echo "benchmarks in $(( $(date +%s) - start )) s"
for f in "$OUT"/expert_parallel_*.log; do echo "== $f"; grep -v "^{" "$f" | grep -v "^\[W\|Warning\|warn" | tail -n 45; done
