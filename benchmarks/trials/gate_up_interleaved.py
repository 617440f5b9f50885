"""Trial: does gate_up lose to down because of its two accumulators? One dot over gate/up rows interleaved.

The gate_up GEMM multiplies each row tile by two [BLOCK_N, BLOCK_K] weight tiles (gate, up) into two
accumulators; the down GEMM by one [BLOCK_N', BLOCK_K] tile into one. Measured on an H200
(results/trials/fused_moe_persistent_*): the down GEMM reached 684 TFLOP/s, gate_up 480-560. Here the same
gate_up runs on a copy of w13 whose rows are interleaved (gate row j at 2j, up row j at 2j + 1): one
[2 BLOCK_N, BLOCK_K] TMA tile, one dot into one [BLOCK_M, 2 BLOCK_N] accumulator, split into gate and up
in the epilogue. Persistent (one program per SM) and one program per tile (as many programs as tiles),
against the production gate_up with the tuned config and its persistent variant, at the issue's prefill
points (T >= 2048). CUDA-graph replay medians; the act rows are checked against production's.

    python benchmarks/trials/gate_up_interleaved.py [--shapes ...] [--tokens 2048,8192] [--out PATH]
"""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moe_infer.kernels.fused_moe import block_schedule, gate_up  # noqa: E402
from moe_infer.kernels.fused_moe_bench import MODEL_SHAPES, graph_time_us, make_inputs, make_weights  # noqa: E402
from moe_infer.kernels.fused_moe_config import get_config  # noqa: E402
from moe_infer.kernels.fused_moe_gemm import tile_of  # noqa: E402
from prefill_points import prefill_parser, run_points  # noqa: E402


@triton.jit
def gate_up_interleaved_kernel(x_ptr, w_desc, act_ptr, sorted_ptr, expert_ptr, num_padded_ptr, num_rows, ROW_DIV, D, F,
                               stride_xm, stride_am, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """act_PF = silu(gate) * up from one dot over w13i [E * 2F, D] (rows 2j, 2j + 1 = gate j, up j)."""
    num_tiles_m = tl.load(num_padded_ptr) // BLOCK_M
    num_tiles_n = tl.cdiv(F, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles_m * num_tiles_n, NUM_PROGRAMS, flatten=False):
        pid_m, pid_n = tile_of(tile, num_tiles_m, num_tiles_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(sorted_ptr + offs_m)
        is_row = rows < num_rows
        e = tl.load(expert_ptr + pid_m)
        a_ptrs = x_ptr + (rows // ROW_DIV).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        w_row = e * 2 * F + pid_n * 2 * BLOCK_N
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(D, BLOCK_K)):
            a = tl.load(a_ptrs + k * BLOCK_K, mask=is_row[:, None] & (offs_k[None, :] < D - k * BLOCK_K), other=0.0)
            w = w_desc.load([w_row, k * BLOCK_K]).T
            acc = tl.dot(a, w, acc)
        g, u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        act = g * tl.sigmoid(g) * u
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=(offs_n < F)[None, :])


def interleaved_gate_up(x_TD, w13i, sched, K, cfg, programs, stages):
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, F2, D = w13i.shape
    F = F2 // 2
    act_PF = torch.empty(max(sched.p_max, 1), F, dtype=x_TD.dtype, device=x_TD.device)
    w_desc = TensorDescriptor.from_tensor(w13i.view(E * F2, D), [2 * cfg.block_n, cfg.block_k])
    gate_up_interleaved_kernel[(programs,)](
        x_TD, w_desc, act_PF, sched.sorted_P, sched.expert_B, sched.num_padded_1, sched.num_rows, K, D, F,
        x_TD.stride(0), act_PF.stride(0), BLOCK_M=sched.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, NUM_PROGRAMS=programs, num_warps=cfg.num_warps, num_stages=stages)
    return act_PF


def bench_point(name, T, w13, w13i):
    E, K, D, F_ = MODEL_SHAPES[name]
    x_TD, ids_TK, _ = make_inputs(T, E, K, D, seed=T)
    cfg = get_config(T, E, F_, D, K, "bf16")
    sched = block_schedule(ids_TK.reshape(-1), E, 0, cfg.block_m, backend=cfg.schedule)
    num_padded = int(sched.num_padded_1)
    n = 30
    base = dataclasses.replace(cfg.gate_up, persistent=False)
    ref = gate_up(x_TD, w13, sched, K, base)[:num_padded]
    sms = torch.cuda.get_device_properties(x_TD.device).multi_processor_count
    tiles = (num_padded // sched.block_m) * triton.cdiv(F_, cfg.gate_up.block_n)
    row = {"shape": name, "tokens": T, "config": cfg.gate_up.__dict__ if hasattr(cfg.gate_up, "__dict__") else None,
           "flops": 2 * T * K * 2 * D * F_}
    times = {"tiles": graph_time_us(lambda: gate_up(x_TD, w13, sched, K, base), n),
             "persistent": graph_time_us(lambda: gate_up(x_TD, w13, sched, K, dataclasses.replace(
                 base, persistent=True, flatten=False)), n)}
    for stages in (3, 4):
        for label, programs in (("tiles", tiles), ("persistent", sms)):
            key = f"interleaved_{label}_s{stages}"
            try:
                got = interleaved_gate_up(x_TD, w13i, sched, K, cfg.gate_up, programs, stages)[:num_padded]
                row[f"{key}_same_bits"] = bool(torch.equal(got, ref))
                row[f"{key}_max_abs_diff"] = float((got.float() - ref.float()).abs().max())
                times[key] = graph_time_us(lambda p=programs, s=stages: interleaved_gate_up(
                    x_TD, w13i, sched, K, cfg.gate_up, p, s), n)
            except Exception as err:  # out of shared memory, a compile failure: recorded
                times[key] = None
                row[f"{key}_error"] = f"{type(err).__name__}: {str(err)[:160]}"
    row["us"] = {k: (round(v, 1) if v else v) for k, v in times.items()}
    row["tflops"] = {k: (round(row["flops"] / (v * 1e-6) / 1e12, 1) if v else v) for k, v in times.items()}
    print(f"{name:14s} T={T:5d} " + "  ".join(f"{k} {v} us ({row['tflops'][k]} TF)" for k, v in row["us"].items())
          + "  same bits " + str({k[:-10]: v for k, v in row.items() if k.endswith("_same_bits")}), flush=True)
    return row


def interleaved_weights(E, D, F):
    """(w13, a copy with its rows interleaved: gate 0, up 0, gate 1, up 1, ...)."""
    w13, _ = make_weights(E, D, F)
    return w13, torch.stack([w13[:, :F], w13[:, F:]], dim=2).reshape(E, 2 * F, D)


def main() -> None:
    run_points(prefill_parser(__doc__).parse_args(), "gate_up_interleaved", bench_point, interleaved_weights)


if __name__ == "__main__":
    main()
