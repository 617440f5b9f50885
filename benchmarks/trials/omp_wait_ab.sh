#!/usr/bin/env bash
# One device call: do the host's OpenMP threads' sleeps cost the offload path's CPU experts?
#  1. benchmarks/trials/cpu_expert_idle.py on the GPU host: one expert after idle gaps, the main thread asleep or
#     busy in Python (as the engine's is, launching GPU work), under OMP_WAIT_POLICY unset / ACTIVE.
#  2. benchmarks/offload.py, Mixtral (16 layers) and Qwen3 shapes, prefetch rule `saving`, in three processes:
#     OMP_WAIT_POLICY unset, ACTIVE, unset again (A B A: the first process of a call has measured slow before).
# Logs and JSONs under $OUT (at most 8 files come back).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/omp_wait_out}
mkdir -p "$OUT"
{
  nvidia-smi -L; nproc; free -g | head -2
  python3 -c 'import torch; print(torch.__version__, torch.get_num_threads()); print(torch.__config__.parallel_info())'
  lscpu | grep -E "Model name|Socket|Thread|Core|NUMA node|L3"
} > "$OUT/env.log" 2>&1
start=$(date +%s)
{
  for policy in unset ACTIVE; do
    for shape in "qwen3 --experts 64 --rows 2 --gaps 0,2,20 --calls 40" "mixtral --experts 8 --rows 1 --gaps 0,20 --calls 20"; do
      for busy in "" --busy; do
        if [ "$policy" = unset ]; then env -u OMP_WAIT_POLICY python3 benchmarks/trials/cpu_expert_idle.py --shape $shape $busy
        else OMP_WAIT_POLICY=$policy python3 benchmarks/trials/cpu_expert_idle.py --shape $shape $busy; fi
      done
    done
  done
} > "$OUT/cpu_expert_idle.log" 2>&1
echo "trial done in $(( $(date +%s) - start )) s"
run() {  # tag policy
  mkdir -p "$OUT/$1"
  if [ "$2" = unset ]; then pre=(env -u OMP_WAIT_POLICY); else pre=(env OMP_WAIT_POLICY=$2); fi
  timeout "${RUN_TIMEOUT:-170}" "${pre[@]}" python3 benchmarks/offload.py --parts mixtral,qwen3 --mixtral-layers 16 \
    --prefetch-rules saving --time-budget 120 --out "$OUT/$1" > "$OUT/offload_$1.log" 2>&1
  echo "offload $1 ($2) rc=$? at $(( $(date +%s) - start )) s"
  grep -E "tok/s|cost model" "$OUT/offload_$1.log"
}
run a unset
run b ACTIVE
[ $(( $(date +%s) - start )) -lt "${ABA_BEFORE:-400}" ] && run c unset
