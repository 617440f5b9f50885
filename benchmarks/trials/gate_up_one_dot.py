"""Trial: the whole fused MoE path with gate_up as one dot (GemmConfig.one_dot) against the tuned config.

At the issue's prefill points (T >= 2048), three configs of fused_experts, timed in the order A B C A B C
(CUDA-graph replay medians, one process): the committed tuned config ("tuned"), the same with gate_up's
weights through TMA as one dot ("one_dot"), and that with a persistent, not flattened gate_up
("one_dot_persistent"). Each output is checked against the tuned config's bits. Prints a table, writes JSON.

    python benchmarks/trials/gate_up_one_dot.py [--shapes ...] [--tokens 2048,8192] [--out PATH]
"""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from moe_infer.kernels.fused_moe import fused_experts  # noqa: E402
from moe_infer.kernels.fused_moe_bench import MODEL_SHAPES, graph_time_us, make_inputs, roofline_us  # noqa: E402
from moe_infer.kernels.fused_moe_config import get_config  # noqa: E402
from prefill_points import prefill_parser, run_points  # noqa: E402


def configs(cfg):
    one = dataclasses.replace(cfg.gate_up, use_tma=True, one_dot=True, persistent=False)
    return {"tuned": cfg, "one_dot": dataclasses.replace(cfg, gate_up=one),
            "one_dot_persistent": dataclasses.replace(cfg, gate_up=dataclasses.replace(one, persistent=True, flatten=False))}


def bench_point(name, T, w13, w2):
    E, K, D, F_ = MODEL_SHAPES[name]
    x_TD, ids_TK, w_TK = make_inputs(T, E, K, D, seed=T)
    cfgs = configs(get_config(T, E, F_, D, K, "bf16"))
    ref = fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, cfgs["tuned"])
    same = {k: bool(torch.equal(fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, c), ref)) for k, c in cfgs.items()}
    times = {k: [] for k in cfgs}
    for _ in range(2):
        for k, c in cfgs.items():
            times[k].append(round(graph_time_us(lambda c=c: fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, c), 30), 1))
    roof = roofline_us(ids_TK, E, D, F_)
    row = {"shape": name, "tokens": T, "roofline_us": round(roof, 1), "us": times, "same_bits": same,
           "pct_roofline": {k: round(100 * roof / min(v), 1) for k, v in times.items()},
           "configs": {k: c.to_dict() for k, c in cfgs.items()}}
    print(f"{name:14s} T={T:5d} " + "  ".join(f"{k} {v}" for k, v in times.items())
          + f"  roof {roof:.0f}  % " + str(row["pct_roofline"]) + f"  same bits {same}", flush=True)
    return row


def main() -> None:
    run_points(prefill_parser(__doc__).parse_args(), "gate_up_one_dot", bench_point)


if __name__ == "__main__":
    main()
