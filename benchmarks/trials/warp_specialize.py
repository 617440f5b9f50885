"""Trial: Triton's automatic warp specialisation (`tl.range(..., warp_specialize=True)`) on the expert GEMMs.

Issue 17 names "persistent or warp-specialised tiles" for the prefill points under 75 % of their roofline. Triton
3.5+ has Hopper's automatic warp specialisation, for loops whose loads are all TMA descriptor loads (a pointer
load beside a dot in the loop is reported to crash the pass: triton-lang/triton#9728). So:

- down: both operands already come through descriptors. A kernel of this file runs the down GEMM (no combine)
  with `warp_specialize` on the persistent tile loop (`ws_tiles`) or, one program per tile, on the K loop
  (`ws_k`), at stages 3/4 and 4/8 warps; `copy` is the same kernel without it (a control against the
  production kernel). Against the tuned config's `down` (the committed file).
- gate_up: its rows are pointer loads, so they are first gathered into slot order (x_PD, one torch gather, timed
  with it) and the one-dot kernel of gate_up_gathered_one_dot.py runs with `warp_specialize` on its persistent
  tile loop. Against the tuned config's `gate_up`.

Each output is compared with the tuned path's bits (the live rows). CUDA-graph replay medians, two rounds. A
variant that fails to compile is recorded; a crash of the compiler takes the process, so run one GEMM and
shape per process (`--gemm`). Prints a row per point, writes JSON.

    python benchmarks/trials/warp_specialize.py --gemm down|gate_up [--shapes ...] [--tokens 2048,8192] [--out PATH]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moe_infer.kernels.fused_moe import block_schedule, down, gate_up  # noqa: E402
from moe_infer.kernels.fused_moe_bench import MODEL_SHAPES, graph_time_us, make_inputs, replays_for, roofline_us  # noqa: E402
from moe_infer.kernels.fused_moe_config import get_config  # noqa: E402
from moe_infer.kernels.fused_moe_gemm import tile_of  # noqa: E402
from fused_moe_persistent import _gather as gather_rows  # noqa: E402
from gate_up_gathered_one_dot import gathered_gate_up  # noqa: E402
from prefill_points import prefill_parser, run_points  # noqa: E402

VARIANTS = [(stages, warps) for stages in (3, 4) for warps in (4, 8)]


@triton.jit
def down_tma_kernel(act_desc, w2_desc, y_ptr, weights_ptr, sorted_ptr, expert_ptr, num_padded_ptr, num_rows, D, F,
                    stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
                    WS_TILES: tl.constexpr, WS_K: tl.constexpr):
    """y[row_p] = weights[row_p] * act_PF[p] @ w2_e.T, both operands by TMA; one program per tile when
    NUM_PROGRAMS is the tile count (its tile loop runs once)."""
    num_tiles_m = tl.load(num_padded_ptr) // BLOCK_M
    num_tiles_n = tl.cdiv(D, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles_m * num_tiles_n, NUM_PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WS_TILES):
        pid_m, pid_n = tile_of(tile, num_tiles_m, num_tiles_n, GROUP_M)
        e = tl.load(expert_ptr + pid_m)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(F, BLOCK_K), warp_specialize=WS_K):
            a = act_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            w = w2_desc.load([e * D + pid_n * BLOCK_N, k * BLOCK_K]).T
            acc = tl.dot(a, w, acc)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.load(sorted_ptr + offs_m)
        is_row = rows < num_rows
        weight = tl.load(weights_ptr + rows, mask=is_row, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=is_row[:, None] & (offs_n < D)[None, :])


def down_tma(act_PF, w2, weights_N, sched, cfg, mode, stages, warps):
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, D, F = w2.shape
    y_ND = torch.empty(sched.num_rows, D, dtype=act_PF.dtype, device=act_PF.device)
    act_desc = TensorDescriptor.from_tensor(act_PF, [sched.block_m, cfg.block_k])
    w2_desc = TensorDescriptor.from_tensor(w2.view(E * D, F), [cfg.block_n, cfg.block_k])
    num_tiles = triton.cdiv(act_PF.shape[0], sched.block_m) * triton.cdiv(D, cfg.block_n)
    sms = torch.cuda.get_device_properties(act_PF.device).multi_processor_count
    programs = num_tiles if mode == "ws_k" else min(sms, num_tiles)
    down_tma_kernel[(programs,)](
        act_desc, w2_desc, y_ND, weights_N, sched.sorted_P, sched.expert_B, sched.num_padded_1, sched.num_rows, D, F,
        y_ND.stride(0), BLOCK_M=sched.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_PROGRAMS=programs, FLATTEN=cfg.flatten, WS_TILES=mode == "ws_tiles", WS_K=mode == "ws_k",
        num_warps=warps, num_stages=stages)
    return y_ND


def _time_all(fns, ref, out_of, n):
    same, times = {}, {k: [] for k in fns}
    for key, fn in fns.items():
        if key != "tuned" and key != "gather_alone":
            try:
                same[key] = bool(torch.equal(out_of(fn()), ref))
            except Exception as err:  # shared memory / compile failure: recorded
                same[key] = f"{type(err).__name__}: {str(err)[:160]}"
    for _ in range(2):
        for key, fn in fns.items():
            if same.get(key, True) is True:
                times[key].append(round(graph_time_us(fn, n), 1))
    return same, times


def bench_point(name, T, w13, w2, gemm):
    E, K, D, F_ = MODEL_SHAPES[name]
    x_TD, ids_TK, w_TK = make_inputs(T, E, K, D, seed=T)
    cfg = get_config(T, E, F_, D, K, "bf16")
    sched = block_schedule(ids_TK.reshape(-1), E, 0, cfg.block_m, backend=cfg.schedule)
    live = int(sched.num_padded_1)
    n = replays_for(roofline_us(ids_TK, E, D, F_) / 2)
    act_PF = gate_up(x_TD, w13, sched, K, cfg.gate_up)
    if gemm == "down":
        weights_N = w_TK.reshape(-1).contiguous()
        tuned_cfg = cfg.down
        ref = down(act_PF, w2, weights_N, sched, tuned_cfg)
        fns = {"tuned": lambda: down(act_PF, w2, weights_N, sched, tuned_cfg),
               "copy": lambda: down_tma(act_PF, w2, weights_N, sched, tuned_cfg, "copy", tuned_cfg.num_stages,
                                        tuned_cfg.num_warps)}
        for mode in ("ws_tiles", "ws_k"):
            for stages, warps in VARIANTS:
                fns[f"{mode}_s{stages}_w{warps}"] = (
                    lambda m=mode, s=stages, w=warps: down_tma(act_PF, w2, weights_N, sched, tuned_cfg, m, s, w))
        same, times = _time_all(fns, ref, lambda y: y, n)
    else:
        tuned_cfg = cfg.gate_up
        ref = act_PF[:live]
        fns = {"tuned": lambda: gate_up(x_TD, w13, sched, K, tuned_cfg),
               "gather_alone": lambda: gather_rows(x_TD, sched, K),
               "gathered": lambda: gathered_gate_up(x_TD, w13, sched, K, tuned_cfg, "persistent", tuned_cfg.num_stages)}
        for stages, warps in VARIANTS:
            fns[f"gathered_ws_s{stages}_w{warps}"] = (lambda s=stages, w=warps: gathered_gate_up(
                x_TD, w13, sched, K, tuned_cfg, "persistent", s, num_warps=w, warp_specialize=True))
        same, times = _time_all(fns, ref, lambda act: act[:live], n)
    flops = 2 * T * K * (2 if gemm == "gate_up" else 1) * D * F_
    tflops = {k: round(flops / (min(v) * 1e-6) / 1e12, 1) for k, v in times.items() if v and k != "gather_alone"}
    row = {"shape": name, "tokens": T, "gemm": gemm, "config": tuned_cfg.__dict__, "block_m": cfg.block_m,
           "us": times, "same_bits": same, "tflops": tflops}
    print(f"{name:14s} T={T:5d} {gemm}: " + "  ".join(f"{k} {v}" for k, v in times.items())
          + f"\n    TFLOP/s {tflops}\n    same {same}", flush=True)
    return row


def main() -> None:
    parser = prefill_parser(__doc__)
    parser.add_argument("--gemm", choices=("down", "gate_up"), required=True)
    args = parser.parse_args()
    run_points(args, f"warp_specialize_{args.gemm}", lambda name, T, w13, w2: bench_point(name, T, w13, w2, args.gemm))


if __name__ == "__main__":
    main()
