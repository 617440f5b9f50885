"""Trial: the persistent prefill GEMMs (fused_moe_persistent.py) against one program per tile.

For each shape at T >= 2048 (the issue's prefill points): each GEMM alone on the real schedule with the
tuned config, then the same tiles persistent (with and without the flattened loop, a few stage counts),
then the whole path (fused_experts) with the tuned config and with the best of each GEMM. CUDA-graph replay,
median. Every variant is checked against the tuned path's bits. Prints a table, writes JSON.

    python benchmarks/trials/fused_moe_persistent.py [--shapes ...] [--tokens 2048,8192] [--out PATH]
"""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from moe_infer.kernels.fused_moe import block_schedule, down, fused_experts, gate_up  # noqa: E402
from moe_infer.kernels.fused_moe_bench import (  # noqa: E402
    MODEL_SHAPES, graph_time_us, make_inputs, replays_for, roofline_us,
)
from moe_infer.kernels.fused_moe_config import get_config  # noqa: E402
from prefill_points import prefill_parser, run_points  # noqa: E402


SWEEP = False  # --sweep: more persistent variants (stages, TMA, GROUP_M, BLOCK_N)


def variants(cfg):
    """The tuned GEMM config, then persistent: flattened at 3 and 4 stages, not flattened at the tuned count;
    with --sweep also not flattened at 3/4 stages x TMA on/off, GROUP_M 4/16 and the other BLOCK_N."""
    out = {"tiles": cfg}
    for stages in (3, 4):
        out[f"persistent_s{stages}"] = dataclasses.replace(cfg, persistent=True, flatten=True, num_stages=stages)
    out["persistent_noflat"] = dataclasses.replace(cfg, persistent=True, flatten=False)
    if SWEEP:
        for stages in (3, 4):
            for tma in (False, True):
                out[f"noflat_s{stages}_tma{int(tma)}"] = dataclasses.replace(
                    cfg, persistent=True, flatten=False, num_stages=stages, use_tma=tma)
        for group_m in (4, 16):
            out[f"noflat_g{group_m}"] = dataclasses.replace(cfg, persistent=True, flatten=False, group_m=group_m)
        other_n = 128 if cfg.block_n == 256 else 256 if cfg.block_n == 128 else cfg.block_n
        for flatten in (False, True):
            out[f"n{other_n}_flat{int(flatten)}"] = dataclasses.replace(
                cfg, persistent=True, flatten=flatten, block_n=other_n, num_stages=3)
    return out


def _gather(x_TD, sched, K):
    """x_PD: the row of each padded slot (a pad slot, or a slot past num_padded, gets a zero row)."""
    x_ext = torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])])
    return x_ext.index_select(0, torch.clamp(sched.sorted_P.long(), 0, sched.num_rows) // K)


def gathered_gate_up(x_TD, w13, sched, K, cfg, flatten, stages):
    """gate_up with its rows gathered first into slot order (x_PD, one torch gather) and read by TMA."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from moe_infer.kernels.fused_moe_persistent import gate_up_persistent_kernel

    E, F2, D = w13.shape
    F = F2 // 2
    x_PD = _gather(x_TD, sched, K)
    act_PF = torch.empty(sched.sorted_P.numel(), F, dtype=x_TD.dtype, device=x_TD.device)
    x_desc = TensorDescriptor.from_tensor(x_PD, [sched.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(w13.view(E * F2, D), [cfg.block_n, cfg.block_k])
    programs = torch.cuda.get_device_properties(x_TD.device).multi_processor_count
    gate_up_persistent_kernel[(programs,)](
        x_desc, w_desc, act_PF, sched.sorted_P, sched.expert_B, sched.num_padded_1, sched.num_rows, K, D, F,
        x_PD.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act_PF.stride(0),
        BLOCK_M=sched.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, IS_FP32_DOT=False,
        USE_TMA=True, DOT_PRECISION="tf32", NUM_PROGRAMS=programs, FLATTEN=flatten, USE_PDL=False, GATHERED=True,
        num_warps=cfg.num_warps, num_stages=stages)
    return act_PF


def time_gemm(fn_of_cfg, cands, n, ref):
    times = {}
    for key, cfg in cands.items():
        try:
            got = fn_of_cfg(cfg)
            same = bool(torch.equal(got, ref)) if ref is not None else None
            times[key] = (round(graph_time_us(lambda c=cfg: fn_of_cfg(c), n), 1), same)
        except Exception as err:  # out of shared memory / a compile failure: recorded, not fatal
            times[key] = (None, f"{type(err).__name__}: {str(err)[:160]}")
    return times


def bench_point(name, T, w13, w2):
    E, K, D, F_ = MODEL_SHAPES[name]
    x_TD, ids_TK, w_TK = make_inputs(T, E, K, D, seed=T)
    cfg = get_config(T, E, F_, D, K, "bf16")
    roof = roofline_us(ids_TK, E, D, F_)
    n = replays_for(roof)
    weights_N = w_TK.reshape(-1)
    sched = block_schedule(ids_TK.reshape(-1), E, 0, cfg.block_m, backend=cfg.schedule)
    num_padded = int(sched.num_padded_1)
    act_ref = gate_up(x_TD, w13, sched, K, cfg.gate_up)
    gu = time_gemm(lambda c: gate_up(x_TD, w13, sched, K, c)[:num_padded], variants(cfg.gate_up), n, act_ref[:num_padded])
    if SWEEP:  # the gather and TMA rows: timed with the gather, not a candidate for the whole path
        for flatten in (False, True):
            for stages in (3, 4):
                key = f"gathered_flat{int(flatten)}_s{stages}"
                gu[key] = time_gemm(lambda c, f=flatten, st=stages: gathered_gate_up(x_TD, w13, sched, K, c, f, st)[:num_padded],
                                    {key: cfg.gate_up}, n, act_ref[:num_padded])[key]
        gu["gather_alone"] = (round(graph_time_us(lambda: _gather(x_TD, sched, K), n), 1), True)
    y_ref = down(act_ref, w2, weights_N, sched, cfg.down)
    dn = time_gemm(lambda c: down(act_ref, w2, weights_N, sched, c), variants(cfg.down), n, y_ref)
    best_gu = min((k for k in gu if gu[k][0] is not None and gu[k][1] is True and not k.startswith("gather")),
                  key=lambda k: gu[k][0])
    best_dn = min((k for k in dn if dn[k][0] is not None and dn[k][1] is True), key=lambda k: dn[k][0])
    best = dataclasses.replace(cfg, gate_up=variants(cfg.gate_up)[best_gu], down=variants(cfg.down)[best_dn])
    ref_TD = fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, cfg)
    whole = {"tuned": round(graph_time_us(lambda: fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, cfg), n), 1),
             "best": round(graph_time_us(lambda: fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, best), n), 1),
             "tuned_again": round(graph_time_us(lambda: fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, cfg), n), 1),
             "best_same_bits": bool(torch.equal(fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, best), ref_TD))}
    flops = 2 * T * K * 3 * D * F_
    row = {"shape": name, "tokens": T, "roofline_us": round(roof, 1), "config": cfg.to_dict(), "gate_up_us": gu,
           "down_us": dn, "best_gate_up": best_gu, "best_down": best_dn, "whole_us": whole,
           "pct_roofline_tuned": round(100 * roof / whole["tuned"], 1),
           "pct_roofline_best": round(100 * roof / whole["best"], 1),
           "gemm_tflops_tuned": round(flops / ((gu["tiles"][0] + dn["tiles"][0]) * 1e-6) / 1e12, 1),
           "gemm_tflops_best": round(flops / ((gu[best_gu][0] + dn[best_dn][0]) * 1e-6) / 1e12, 1)}
    print(f"{name:14s} T={T:5d} gate_up " + " ".join(f"{k} {v[0]}{'' if v[1] is True else '!' + str(v[1])}" for k, v in gu.items())
          + " | down " + " ".join(f"{k} {v[0]}{'' if v[1] is True else '!' + str(v[1])}" for k, v in dn.items())
          + f" | whole tuned {whole['tuned']}/{whole['tuned_again']} best {whole['best']} ({best_gu}, {best_dn}, "
          f"same bits {whole['best_same_bits']}) roof {roof:.0f}: {row['pct_roofline_tuned']} -> {row['pct_roofline_best']} %",
          flush=True)
    return row


def main() -> None:
    parser = prefill_parser(__doc__)
    parser.add_argument("--sweep", action="store_true", help="more persistent variants, and gathered rows by TMA")
    args = parser.parse_args()
    global SWEEP
    SWEEP = args.sweep
    run_points(args, "fused_moe_persistent", bench_point)


if __name__ == "__main__":
    main()
