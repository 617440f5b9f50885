"""The routing kernels built for sm_90 without a GPU (through sass_report.py), at the launch configurations the
wrappers pick for benchmarks/routing.py's models at 8192 tokens: ptxas' registers and spills, the SASS size per token.

    python scripts/routing_sass.py

With the run-time alignment facts: pointers and the logits' row stride / E divisible by 16, unit last stride.
"""
from __future__ import annotations

import os
import sys

import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, ".."), os.path.join(HERE, "..", "benchmarks")]

from routing import BLOCK_SIZE, MODELS  # noqa: E402  (benchmarks/routing.py)
from sass_report import build, report  # noqa: E402

PTR_TYPES = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "bias_ptr": "*fp32", "w_out_ptr": "*fp32",
             "ids_ptr": "*i32", "tile_counts_ptr": "*i32", "hist_ptr": "*i8", "within_ptr": "*i8",
             "sorted_rows_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32"}  # other pointers: int64


def ptxas_report(fn, consts, num_warps, tokens_per_warp, label):
    """Build `fn` for sm_90 without a device (sass_report.py, with the run-time alignment facts); print registers,
    spills and warp-instructions per token."""
    types = {**PTR_TYPES, "routed_scaling_factor": "fp32"}
    consts = {**consts, **({"stride_le": 1} if "stride_le" in fn.arg_names else {})}
    r = report(*build(fn, consts, types, {"E", "stride_lt"}, num_warps, 3))
    per_token = f" warp-instr/token={r['sass'] / tokens_per_warp:.0f}" if tokens_per_warp else ""
    print(f"{label:40s} warps={num_warps} regs={r['registers']} spill_bytes={r['spill_bytes']} "
          f"sass={r['sass']}{per_token} REDUX={r['REDUX']} SHFL={r['SHFL']}")


def main() -> None:
    from moe_infer.kernels.permute_rows import tile_hist_kernel, tile_scan_kernel, tile_scatter_kernel
    from moe_infer.kernels.routing_gate import routing_gate_kernel
    from moe_infer.routing.triton_permute import FILL, _blocks, _warps
    from moe_infer.routing.triton_route import GROUP_ROWS, SCATTER_ROWS
    from moe_infer.routing.triton_select import gate_launch_config

    T = 8192
    for name, spec in MODELS.items():
        E, G = spec.num_experts, spec.num_expert_group
        bt, be, warps = gate_launch_config(T, E)
        consts = dict(K=spec.top_k, G=G, TOPK_GROUP=spec.topk_group, IS_SIGMOID=spec.scoring == "sigmoid",
                      HAS_BIAS=spec.has_score_bias, RENORMALIZE=spec.renormalize,
                      GROUP_RESHAPE=E == be and G == triton.next_power_of_2(G), BLOCK_T=bt, BLOCK_E=be,
                      BLOCK_K=triton.next_power_of_2(spec.top_k), BLOCK_G=triton.next_power_of_2(G),
                      TILE_COUNTS=False, FILL=1, GROUP_TILES=1)
        ptxas_report(routing_gate_kernel, consts, warps, bt / warps, f"gate {name} BT{bt}")
        bn, bb = _blocks(be)
        consts = dict(HAS_ORDER=False, BLOCK_N=bn, BLOCK_E=be, FILL=FILL)
        ptxas_report(tile_hist_kernel, consts, _warps(be), None, f"permute hist {name} BN{bn}")
        consts = dict(HAS_ORDER=False, WRITE_RANK=False, WRITE_PERMUTE=True, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=bn,
                      BLOCK_E=be, BLOCK_B=bb, HAS_WITHIN=False, TILE_N=bn, GROUP_TILES=1)
        ptxas_report(tile_scatter_kernel, consts, _warps(be), None, f"permute scatter {name} BN{bn} BB{bb}")
    # the fused path at the target point (route_rows_triton's defaults at T=8192, E=256), with PDL
    spec = MODELS["E256_K8_grouped"]
    bt, be, warps = gate_launch_config(T, 256)
    group_tiles = triton.next_power_of_2(max(1, GROUP_ROWS // (bt * 8)))
    consts = dict(K=8, G=8, TOPK_GROUP=4, IS_SIGMOID=True, HAS_BIAS=True, RENORMALIZE=spec.renormalize,
                  GROUP_RESHAPE=True, BLOCK_T=bt, BLOCK_E=be, BLOCK_K=8, BLOCK_G=8, TILE_COUNTS=True,
                  FILL=triton.next_power_of_2(triton.cdiv(T * 8 + 256 * 63, T // bt)), GROUP_TILES=group_tiles,
                  USE_PDL=True)
    ptxas_report(routing_gate_kernel, consts, warps, bt / warps, f"fused gate E256 BT{bt} PDL")
    ptxas_report(tile_scan_kernel, dict(BLOCK_E=be, BLOCK_S=512, CHUNK_E=8, USE_PDL=True), 4, None,
                 "fused scan E256 PDL")
    consts = dict(HAS_ORDER=False, WRITE_RANK=False, WRITE_PERMUTE=True, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=SCATTER_ROWS,
                  BLOCK_E=be, BLOCK_B=_blocks(be)[1], HAS_WITHIN=True, TILE_N=bt * 8, GROUP_TILES=group_tiles,
                  ZERO_GROUPS=True, USE_PDL=True)
    ptxas_report(tile_scatter_kernel, consts, 4, None, f"fused scatter E256 BN{SCATTER_ROWS} zero-groups PDL")


if __name__ == "__main__":
    main()
