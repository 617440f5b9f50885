"""Trial: gate_up as one dot with its rows gathered first into slot order and read through TMA.

gate_up reads its rows by pointer loads from x_TD (row // K of each slot), while the down GEMM, which reads
both operands through TMA, runs at about 684 TFLOP/s on an H200 where one-dot gate_up reaches 507-647. Here
the rows are first gathered into x_PD [P, D] (one torch index_select; its time is counted), then a kernel of
this file runs gate_up with both operands through TMA descriptors (x_PD block [BLOCK_M, BLOCK_K], w13 viewed
[E, 2, F, D] block [1, 2, BLOCK_N, BLOCK_K]) as one dot into a [BLOCK_M, 2 BLOCK_N] accumulator, one program
per tile or persistent (flattened or not). Against the tuned config's gate_up (the committed file), at the
prefill points; each output is checked against the tuned act's bits (live slots). CUDA-graph replay medians,
two rounds. Prints a table, writes JSON.

    python benchmarks/trials/gate_up_gathered_one_dot.py [--shapes ...] [--tokens 2048,8192] [--out PATH]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moe_infer.kernels.fused_moe import block_schedule, gate_up  # noqa: E402
from moe_infer.kernels.fused_moe_bench import MODEL_SHAPES, graph_time_us, make_inputs, replays_for, roofline_us  # noqa: E402
from moe_infer.kernels.fused_moe_config import get_config  # noqa: E402
from moe_infer.kernels.fused_moe_gemm import tile_of  # noqa: E402
from fused_moe_persistent import _gather as gather_rows  # noqa: E402  (x_PD: each padded slot's row)
from prefill_points import prefill_parser, run_points  # noqa: E402


@triton.jit
def gathered_one_dot_kernel(x_desc, w13_desc, act_ptr, expert_ptr, num_padded_ptr, D, F, stride_am,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
                            WARP_SPECIALIZE: tl.constexpr = False):  # benchmarks/trials/warp_specialize.py
    num_tiles_m = tl.load(num_padded_ptr) // BLOCK_M
    num_tiles_n = tl.cdiv(F, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles_m * num_tiles_n, NUM_PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = tile_of(tile, num_tiles_m, num_tiles_n, GROUP_M)
        e = tl.load(expert_ptr + pid_m)
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(D, BLOCK_K)):
            a = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            w = tl.reshape(w13_desc.load([e, 0, pid_n * BLOCK_N, k * BLOCK_K]), [2 * BLOCK_N, BLOCK_K]).T
            acc = tl.dot(a, w, acc)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=(offs_n < F)[None, :])


def gathered_gate_up(x_TD, w13, sched, K, cfg, mode, stages, num_warps=None, warp_specialize=False):
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, F2, D = w13.shape
    F = F2 // 2
    x_PD = gather_rows(x_TD, sched, K)
    act_PF = torch.empty(sched.sorted_P.numel(), F, dtype=x_TD.dtype, device=x_TD.device)
    x_desc = TensorDescriptor.from_tensor(x_PD, [sched.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(w13.view(E, 2, F, D), [1, 2, cfg.block_n, cfg.block_k])
    num_tiles = triton.cdiv(sched.sorted_P.numel(), sched.block_m) * triton.cdiv(F, cfg.block_n)
    programs = num_tiles if mode == "tiles" else torch.cuda.get_device_properties(x_TD.device).multi_processor_count
    gathered_one_dot_kernel[(programs,)](
        x_desc, w_desc, act_PF, sched.expert_B, sched.num_padded_1, D, F, act_PF.stride(0),
        BLOCK_M=sched.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_PROGRAMS=programs, FLATTEN=mode == "flat", WARP_SPECIALIZE=warp_specialize,
        num_warps=num_warps or cfg.num_warps, num_stages=stages)
    return act_PF


def bench_point(name, T, w13, w2):
    E, K, D, F_ = MODEL_SHAPES[name]
    x_TD, ids_TK, w_TK = make_inputs(T, E, K, D, seed=T)
    cfg = get_config(T, E, F_, D, K, "bf16")
    sched = block_schedule(ids_TK.reshape(-1), E, 0, cfg.block_m, backend=cfg.schedule)
    live = int(sched.num_padded_1)
    ref = gate_up(x_TD, w13, sched, K, cfg.gate_up)[:live]
    n = replays_for(roofline_us(ids_TK, E, D, F_) * 2 / 3)
    fns = {"tuned": lambda: gate_up(x_TD, w13, sched, K, cfg.gate_up), "gather_alone": lambda: gather_rows(x_TD, sched, K)}
    for mode in ("tiles", "persistent", "flat"):
        for stages in (3, 4):
            fns[f"gathered_{mode}_s{stages}"] = lambda m=mode, s=stages: gathered_gate_up(x_TD, w13, sched, K, cfg.gate_up, m, s)
    same, times = {}, {k: [] for k in fns}
    for key, fn in fns.items():
        if key.startswith("gathered"):
            try:
                same[key] = bool(torch.equal(fn()[:live], ref))
            except Exception as err:  # shared memory / compile failure: recorded
                same[key] = f"{type(err).__name__}: {str(err)[:120]}"
    for _ in range(2):
        for key, fn in fns.items():
            if same.get(key, True) is True:
                times[key].append(round(graph_time_us(fn, n), 1))
    flops = 2 * T * K * 2 * D * F_
    tflops = {k: round(flops / (min(v) * 1e-6) / 1e12, 1) for k, v in times.items() if v and k != "gather_alone"}
    row = {"shape": name, "tokens": T, "gate_up_config": cfg.gate_up.__dict__, "block_m": cfg.block_m, "us": times,
           "same_bits": same, "tflops": tflops}
    print(f"{name:14s} T={T:5d} " + "  ".join(f"{k} {v}" for k, v in times.items()) + f"  TFLOP/s {tflops}  same {same}",
          flush=True)
    return row


def main() -> None:
    run_points(prefill_parser(__doc__).parse_args(), "gate_up_gathered_one_dot", bench_point)


if __name__ == "__main__":
    main()
