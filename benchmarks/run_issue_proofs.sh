#!/usr/bin/env bash
# The proofs of issues 17 and 20 on a lent GPU, in parts that each fit one device call (10 minutes), with every
# log and JSON under $OUT (8 files at most come back from a call, so each part writes few):
#
#   bash benchmarks/run_issue_proofs.sh kernels   # ~6 min: the GPU suite, tune_fused_moe.py --refine at the
#                                                 # prefill points (into this GPU's tuned files, tarred back),
#                                                 # then benchmarks/fused_moe.py with them
#   bash benchmarks/run_issue_proofs.sh engine    # ~5 min: benchmarks/engine_roofline.py (issue 17's engine
#                                                 # targets, transformers in the same run) and benchmarks/attention.py
#   bash benchmarks/run_issue_proofs.sh offload   # ~4-7 min: benchmarks/offload.py (issue 20: both shapes,
#                                                 # accelerate, NVMe)
#   bash benchmarks/run_issue_proofs.sh offload_ab  # ~3-4 min: the Mixtral shape with offload.expert_graphs
#                                                 # off, then on, in one process (measured at 9ca4577: on by default since)
#   bash benchmarks/run_issue_proofs.sh mesh      # benchmarks/mesh_scaling.py on every GPU of the machine (one GPU:
#                                                 # the plain engine and the mesh at degree 1, A B B A; ~5 min)
#
# Run the parts back to back (the machine stays warm between calls). The device checkout has no git metadata:
# pass GIT_COMMIT=<the tree's commit> so the logs name it. The tuned files come back as tuned_configs.tgz; unpack
# it into the repository root (tar xzf) to commit them.
set -u
part=${1:?"usage: run_issue_proofs.sh kernels|engine|offload|offload_ab|mesh"}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue_proofs}
mkdir -p "$OUT"
log="$OUT/proofs_$part.log"
{
  echo "# $part at ${GIT_COMMIT:-unknown commit}, $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} > "$log" 2>&1
step() {  # step NAME TIMEOUT_S COMMAND...: run it, its output appended to the part's log, rc and seconds noted
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "## $name: $*" >> "$log"
  timeout "$limit" "$@" >> "$log" 2>&1
  echo "## $name rc=$? in $((SECONDS - start)) s" | tee -a "$log"
}
case "$part" in
  kernels)
    step gpu_suite 300 python3 -m pytest -q -m gpu -n "${WORKERS:-8}" -p no:cacheprovider -rfEs tests/
    step refine 150 python3 scripts/tune_fused_moe.py --refine --tokens 2048,8192
    tar czf "$OUT/tuned_configs.tgz" moe_infer/kernels/configs
    step fused_moe 240 python3 benchmarks/fused_moe.py --out "$OUT/fused_moe.json"
    ;;
  engine)
    step engine_roofline 330 python3 benchmarks/engine_roofline.py --compare-attention '' --out "$OUT/engine_roofline.json"
    step attention 180 python3 benchmarks/attention.py --out "$OUT/attention.json"
    ;;
  offload)
    step offload 560 python3 benchmarks/offload.py --out "$OUT"
    ;;
  offload_ab)
    step offload_ab 560 python3 benchmarks/offload.py --parts mixtral --prefetch-rules saving --expert-graphs off,on \
      --time-budget 420 --out "$OUT"
    ;;
  mesh)
    step mesh_scaling 560 python3 benchmarks/mesh_scaling.py --timeout 540 --out "$OUT/mesh_scaling.json"
    ;;
  *)
    echo "unknown part $part: kernels, engine, offload, offload_ab or mesh" >&2
    exit 2
    ;;
esac
grep -E "passed|failed|target|met|tok/s|wrote|refined|unchanged" "$log" | grep -v -e "^\[" -e "^## " | tail -n 40
