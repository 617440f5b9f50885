#!/usr/bin/env bash
# One device call on nvidia-h200-x4: NCCL equality tests (2 and 4 ranks), then the EP benchmark at
# EP=4, then EP=2 (GPUs 0,1) alongside EP=1 (GPU 2). Results and logs under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ep_gpu_out}
mkdir -p "$OUT"
ITERS=${ITERS:-8}
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
start=$(date +%s)
timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -q -m gpu tests/test_ep_gpu.py -p no:cacheprovider -rA \
  > "$OUT/ep_gpu_tests.log" 2>&1
echo "tests rc=$? in $(( $(date +%s) - start )) s"; grep -E "passed|failed|PASSED|FAILED|Error" "$OUT/ep_gpu_tests.log" | tail -8
bench() {  # nproc gpus out
  CUDA_VISIBLE_DEVICES=$2 timeout "${BENCH_TIMEOUT:-100}" torchrun --standalone --nproc-per-node "$1" \
    benchmarks/expert_parallel.py --iters "$ITERS" --out "$OUT/$3" > "$OUT/${3%.json}.log" 2>&1
  echo "bench ep=$1 rc=$?"
}
start=$(date +%s)
bench 4 0,1,2,3 expert_parallel_4xh200_ep4.json
bench 2 0,1 expert_parallel_4xh200_ep2.json & bench 1 2 expert_parallel_4xh200_ep1.json & wait
echo "benchmarks in $(( $(date +%s) - start )) s"
for f in ep1 ep2 ep4; do tail -n 18 "$OUT/expert_parallel_4xh200_$f.log" | grep -v "^{" ; done
