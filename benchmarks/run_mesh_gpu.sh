#!/usr/bin/env bash
# The multi-GPU run of the mesh, in parts that each fit one 10-minute device call (GPUs of one host; NVLink
# multicast stays off). Logs and JSON under $OUT.
#   bash benchmarks/run_mesh_gpu.sh tests   # the multi-GPU tests: mesh layouts and DP attention against one GPU, EP
#   bash benchmarks/run_mesh_gpu.sh small   # mesh_scaling.py, the 8-layer shape: every layout against one GPU
#   bash benchmarks/run_mesh_gpu.sh large   # mesh_scaling.py, the 48-layer shape (tp, ep), then expert_parallel.py
#                                           # at ep = every GPU (ONLY_EP=1: that alone, e.g. on 4 or 8 GPUs)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mesh_gpu_out}
mkdir -p "$OUT"
NG=$(python3 -c 'import torch; print(torch.cuda.device_count())')
start=$(date +%s)
case "${1:-small}" in
  tests)
    timeout "${LIMIT_S:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs tests/test_mesh_gpu.py \
      tests/test_ep_gpu.py tests/test_ep_rebalance.py > "$OUT/mesh_gpu_tests_x$NG.log" 2>&1
    echo "tests rc=$?"; tail -25 "$OUT/mesh_gpu_tests_x$NG.log" ;;
  small)
    timeout "${LIMIT_S:-560}" python3 benchmarks/mesh_scaling.py --models small --timeout "${LAYOUT_S:-150}" \
      --out "$OUT/" > "$OUT/mesh_scaling_small_x$NG.log" 2>&1
    echo "small rc=$?"; grep -v "^\[W\|Warning" "$OUT/mesh_scaling_small_x$NG.log" | tail -70 ;;
  large)
    [ "${ONLY_EP:-0}" = 1 ] || timeout "${LIMIT_S:-380}" python3 benchmarks/mesh_scaling.py --models large --layouts "${LAYOUTS:-tp=$NG,ep=$NG}" \
      --batches 1,64 --prefill 4x1024 --timeout 180 --out "$OUT/" > "$OUT/mesh_scaling_large_x$NG.log" 2>&1
    echo "large rc=$?"; grep -v "^\[W\|Warning" "$OUT/mesh_scaling_large_x$NG.log" | tail -30
    timeout 200 torchrun --standalone --nproc-per-node "$NG" benchmarks/expert_parallel.py --iters 20 \
      --out "$OUT/expert_parallel_ep$NG.json" > "$OUT/expert_parallel_ep$NG.log" 2>&1
    echo "expert_parallel ep=$NG rc=$?"; grep -v "^{\|^\[W\|Warning" "$OUT/expert_parallel_ep$NG.log" | tail -40 ;;
  *) echo "usage: $0 tests|small|large"; exit 2 ;;
esac
echo "done in $(( $(date +%s) - start )) s"
