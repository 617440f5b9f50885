"""Tune the fused MoE launch configs on the GPU at hand and write them as JSON (one file per
(E, F, D, dtype, device), keyed by token count) into moe_infer/kernels/configs/.

For each token count: for each BLOCK_M that suits the rows per expert, time every gate_up and every
down candidate on the real schedule (triton.testing.do_bench, median), keep the best of each, and
keep the BLOCK_M whose two GEMMs sum to the least time. With --persistent, every candidate of BLOCK_M
>= 64 is also tried as a persistent GEMM (fused_moe_persistent.py), flattened or not; with --one-dot, every
gate_up candidate also as one dot through TMA (GemmConfig.one_dot).

--refine searches less: from the config in use at each token count (the committed file's, else the
heuristic), each GEMM with its tiles unchanged and the options toggled (gate_up: one dot or two, one
program a tile or persistent, flattened or not; down: the last two, and a persistent flattened TMA tile of 8 warps
also warp-specialised, GemmConfig.warp_specialize), the fastest of each GEMM alone; the
result replaces the config only if the whole path (CUDA-graph replay) is faster by --min-gain in each of
two rounds timed A B B A (a timing of one config moves by 5-8 % on an H200 with the GPU's clock state, so one
round decides nothing).
Minutes instead of an hour: what a short session on a newly lent GPU has time for.

--format int4_g128 | int4_g32 | mxfp4: the W4A16 kernels (moe_infer/kernels/fused_moe_w4a16.py) on random weights of
that format, each BLOCK_M's gate_up tile then its down tile chosen by timing the whole call (no TMA / persistent
variants: those kernels have none); written as dtype=<format> files, which `w4_config` reads.

--format fp8_w8a8: the block-scaled W8A8 kernels (moe_infer/kernels/fused_moe_fp8.py) on random fp8 weights with
128 x 128 block scales: per BLOCK_M, gate_up's warps / stages (its column and K tiles are the 128-wide scale group),
then down's column tile, warps and stages, each timed as the whole call (7 calls a BLOCK_M); dtype=fp8_w8a8 files,
which `fp8_tiles` reads. One token also times the matrix-vector path that the engine takes there (fp8_expert_gemv),
for comparison. On an H200, the qwen3-30b-a3b and deepseek-v3 shapes at tokens 1,8,32,128,512,2048 take about
3-4 minutes (about 36 kernel compilations a shape at ~2 s, ~100 timed calls at ~0.1 s, and ~10 s making
DeepSeek-V3's 11 GB of fp8 experts).

An existing file for the shape and device keeps its other token counts (--replace: write only those tuned).

    python scripts/tune_fused_moe.py [--shapes mixtral-8x7b,64:8:2048:1024,...] [--tokens 1,8,...] [--out-dir DIR]
                                     [--persistent] [--one-dot] [--refine [--min-gain 0.02]] [--replace]
                                     [--format bf16|int4_g128|int4_g32|mxfp4|fp8_w8a8]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from moe_infer.kernels import fused_moe_config  # noqa: E402
from moe_infer.kernels.fused_moe import block_schedule, down, fused_experts, gate_up  # noqa: E402
from moe_infer.kernels.fused_moe_bench import (  # noqa: E402
    MODEL_SHAPES, TOKEN_COUNTS, graph_time_us, make_inputs, make_weights,
)
from moe_infer.kernels.fused_moe_config import (  # noqa: E402
    CONFIG_DIR, FusedMoEConfig, GemmConfig, config_file_name, device_name, get_config, load_configs,
)

# (block_n, block_k, num_warps, num_stages[, use_tma]) per BLOCK_M; gate_up holds two accumulators.
T = True
GATE_UP = {
    16: [(32, 128, 4, 4), (64, 128, 4, 4), (64, 64, 4, 5), (32, 256, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3),
         (32, 256, 4, 4, T), (64, 128, 4, 4, T)],
    32: [(64, 128, 4, 4), (64, 64, 4, 5), (128, 64, 4, 4), (32, 128, 4, 4), (64, 128, 4, 4, T)],
    64: [(64, 64, 4, 4), (128, 64, 8, 4), (64, 128, 4, 3), (64, 64, 4, 4, T), (128, 64, 8, 4, T), (64, 128, 4, 3, T)],
    128: [(64, 64, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 4, T), (128, 64, 8, 3, T), (64, 64, 8, 4, T)],
}
DOWN = {
    16: [(32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (32, 256, 4, 4), (16, 256, 4, 4), (32, 512, 4, 3),
         (32, 256, 4, 4, T), (64, 128, 4, 4, T)],
    32: [(64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 5), (128, 128, 8, 3), (128, 128, 8, 3, T)],
    64: [(128, 64, 4, 4), (128, 64, 8, 4), (256, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4, T), (256, 64, 8, 3, T),
         (128, 128, 8, 3, T)],
    128: [(128, 64, 8, 4), (256, 64, 8, 3), (128, 128, 8, 3), (256, 64, 8, 3, T), (128, 64, 8, 4, T), (256, 64, 8, 4, T)],
}


def block_m_candidates(rows_per_expert: float):
    for bound, cands in ((4, [16]), (16, [16, 32]), (48, [16, 32, 64]), (256, [32, 64, 128])):
        if rows_per_expert <= bound:
            return cands
    return [64, 128]


def _bench(fn) -> float:
    try:
        fn()
        return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3
    except Exception as err:  # out of shared memory / registers for this tile: not a candidate
        print(f"    skipped: {type(err).__name__}: {str(err)[:80]}")
        return float("inf")


def candidates(cands, block_m, persistent: bool, one_dot: bool = False):
    """GemmConfigs of the (block_n, block_k, num_warps, num_stages[, use_tma]) tuples; with persistent (BLOCK_M
    >= 64 only: prefill) each also as a persistent GEMM with and without the flattened loop; with one_dot
    (gate_up) each also through TMA as one dot."""
    group_m = 1 if block_m <= 32 else 8
    for c in cands:
        base = GemmConfig(c[0], c[1], group_m, *c[2:])
        for cfg in [base] + ([dataclasses.replace(base, use_tma=True, one_dot=True)] if one_dot else []):
            yield cfg
            if persistent and block_m >= 64:
                for flatten in (False, True):
                    yield dataclasses.replace(cfg, persistent=True, flatten=flatten)


def _best(fn_of_cfg, cands, block_m, persistent=False, one_dot=False):
    timed = [(_bench(lambda c=c: fn_of_cfg(c)), c) for c in candidates(cands, block_m, persistent, one_dot)]
    return min(timed, key=lambda tc: tc[0])


def tune_point(T, E, K, D, F, w13, w2, persistent=False, one_dot=False):
    x_TD, ids_TK, w_TK = make_inputs(T, E, K, D)
    best = None
    for block_m in block_m_candidates(T * K / E):
        sched = block_schedule(ids_TK.reshape(-1), E, 0, block_m)
        t_gu, cfg_gu = _best(lambda c: gate_up(x_TD, w13, sched, K, c), GATE_UP[block_m], block_m, persistent, one_dot)
        act_PF = gate_up(x_TD, w13, sched, K, cfg_gu)
        weights_N = w_TK.reshape(-1)
        t_dn, cfg_dn = _best(lambda c: down(act_PF, w2, weights_N, sched, c), DOWN[block_m], block_m, persistent)
        print(f"  T={T} BLOCK_M={block_m}: gate_up {t_gu:.1f} us {cfg_gu}, down {t_dn:.1f} us {cfg_dn}")
        if best is None or t_gu + t_dn < best[0]:
            best = (t_gu + t_dn, FusedMoEConfig(block_m, cfg_gu, cfg_dn))
    return best


W4_FORMATS = ("int4_g128", "int4_g32", "mxfp4")


def w4_weights(fmt: str, E: int, D: int, F: int):
    """Random weights of a 4-bit format (random codes, scales of N(0, 1 / fan_in) weights): (w13, w2) tuples."""
    out = []
    for N, K in ((2 * F, D), (D, F)):
        if fmt == "mxfp4":
            out.append((torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda"),
                        torch.full((E, N, K // 32), 127 - 3, dtype=torch.uint8, device="cuda")))
        else:
            group = int(fmt.split("_g")[1])
            out.append((torch.randint(-2 ** 31, 2 ** 31, (E, N, K // 8), dtype=torch.int64, device="cuda").int(),
                        torch.full((E, N, K // group), K ** -0.5 / 8, dtype=torch.bfloat16, device="cuda")))
    return out


def tune_w4_point(T, E, K, D, F, fmt, w13, w2):
    """(us, FusedMoEConfig) of the W4A16 path at T tokens: per BLOCK_M, the best gate_up tile with the heuristic's
    down tile, then the best down tile with it (each timed as the whole call)."""
    from moe_infer.kernels.fused_moe_w4a16 import fused_moe_w4a16

    x_TD, ids_TK, w_TK = make_inputs(T, E, K, D)
    kind, group = ("mxfp4", 32) if fmt == "mxfp4" else ("int4", int(fmt.split("_g")[1]))

    def run(cfg):
        return fused_moe_w4a16(x_TD, ids_TK, w_TK, kind, *w13, *w2, group, config=cfg)

    best = None
    for block_m in block_m_candidates(T * K / E):
        base = fused_moe_config.default_config(T, E, K)
        plain = lambda cands: [c for c in cands if len(c) == 4 and c[1] >= 32]  # noqa: E731  no TMA; K tiles >= 32
        t_gu, cfg_gu = _best(lambda c: run(FusedMoEConfig(block_m, c, base.down)), plain(GATE_UP[block_m]), block_m)
        t_all, cfg_dn = _best(lambda c: run(FusedMoEConfig(block_m, cfg_gu, c)), plain(DOWN[block_m]), block_m)
        print(f"  T={T} BLOCK_M={block_m}: {t_all:.1f} us, gate_up {cfg_gu}, down {cfg_dn}")
        if best is None or t_all < best[0]:
            best = (t_all, FusedMoEConfig(block_m, cfg_gu, cfg_dn))
    return best


FP8_FORMAT = "fp8_w8a8"
FP8_BLOCK = 128  # the block of the weights tuned for (DeepSeek-V3's and Qwen3 FP8's 128 x 128)
FP8_GATE_UP = [(4, 3), (4, 4), (8, 3)]  # (num_warps, num_stages); its column and K tiles are FP8_BLOCK
FP8_DOWN = [(64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3)]  # (block_n, num_warps, num_stages)


def fp8_weights(E: int, D: int, F: int):
    """Random fp8 experts with 128 x 128 block scales: ((w13, scale), (w2, scale)), made an expert at a time (the
    bf16 temporaries of DeepSeek-V3's 256 experts at once would take 22 GB)."""
    out = []
    for N, K in ((2 * F, D), (D, F)):
        w = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device="cuda")
        for e in range(E):
            w[e] = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 32).to(torch.float8_e4m3fn)
        scale = torch.full((E, triton.cdiv(N, FP8_BLOCK), K // FP8_BLOCK), K ** -0.5 / 32, device="cuda")
        out.append((w, scale))
    return out


def fp8_candidates(block_m: int):
    """(gate_up MoETiles list, down MoETiles list of a given gate_up) at one BLOCK_M."""
    from moe_infer.kernels.fused_moe_fp8 import MoETiles

    group_m = 1 if block_m <= 32 else 8
    down_n = 64 if block_m <= 16 else 128
    gate_ups = [MoETiles(block_m, down_n, group_m, w, s) for w, s in FP8_GATE_UP]
    return gate_ups, lambda gu: [dataclasses.replace(gu, block_n_down=n, down_warps=w, down_stages=s)
                                 for n, w, s in FP8_DOWN]


def tune_fp8_point(T, E, K, D, F, w13, w2):
    """(us, FusedMoEConfig) of the W8A8 tile path at T tokens (as `fused_moe_fp8` with config=...): per BLOCK_M the
    best gate_up setting, then the best down tile with it, each timed as the whole call."""
    from moe_infer.kernels.fused_moe_fp8 import fused_moe_fp8

    x_TD, ids_TK, w_TK = make_inputs(T, E, K, D)

    def run(tiles=None):
        return fused_moe_fp8(x_TD, ids_TK, w_TK, *w13, *w2, FP8_BLOCK, FP8_BLOCK, config=tiles)

    if T == 1:
        print(f"  T=1: the matrix-vector path the engine takes: {_bench(run):.1f} us")
    best = None
    for block_m in block_m_candidates(T * K / E):
        gate_ups, downs = fp8_candidates(block_m)
        t_gu, gu = min(((_bench(lambda c=c: run(c)), c) for c in gate_ups), key=lambda tc: tc[0])
        t_all, tiles = min(((_bench(lambda c=c: run(c)), c) for c in downs(gu)), key=lambda tc: tc[0])
        print(f"  T={T} BLOCK_M={block_m}: {t_all:.1f} us, {tiles}")
        if best is None or t_all < best[0]:
            best = (t_all, tiles.to_config(FP8_BLOCK))
    return best


def option_variants(cfg: GemmConfig, block_m: int, is_gate_up: bool):
    """cfg with its tiles kept and the options toggled: one dot or two (gate_up), one program a tile or
    persistent (BLOCK_M >= 64, as `candidates`), flattened or not, warp-specialised or not (down, where
    GemmConfig allows it); cfg itself first, no duplicates (`flatten` means nothing without `persistent`)."""
    def same(a: GemmConfig, b: GemmConfig) -> bool:
        return dataclasses.replace(a, flatten=a.flatten or not a.persistent) == \
            dataclasses.replace(b, flatten=b.flatten or not b.persistent)

    plain = dataclasses.replace(cfg, warp_specialize=False)
    dots = [dataclasses.replace(plain, one_dot=False), dataclasses.replace(plain, use_tma=True, one_dot=True)] \
        if is_gate_up else [plain]
    out = [cfg]
    for base in dots:
        modes = [dataclasses.replace(base, persistent=False)]
        if block_m >= 64:
            modes += [dataclasses.replace(base, persistent=True, flatten=f) for f in (False, True)]
        if not is_gate_up:
            modes += [dataclasses.replace(m, warp_specialize=True) for m in modes
                      if m.persistent and m.flatten and m.use_tma and m.num_warps == 8]
        out += [m for m in modes if not any(same(m, o) for o in out)]
    return out


def keep_refined(base_us, new_us, min_gain: float) -> bool:
    """The refined config replaces the base only if it is faster by min_gain in every round."""
    return len(base_us) == len(new_us) > 0 and all(n <= b * (1.0 - min_gain) for b, n in zip(base_us, new_us))


def refine_point(T, E, K, D, F, w13, w2, min_gain: float, rounds: int = 2):
    """(base config, refined config, base whole-path us per round, refined us per round, kept?)."""
    base = get_config(T, E, F, D, K, "bf16")
    x_TD, ids_TK, w_TK = make_inputs(T, E, K, D)
    weights_N = w_TK.reshape(-1)
    sched = block_schedule(ids_TK.reshape(-1), E, 0, base.block_m, backend=base.schedule)
    t_gu, cfg_gu = min(((_bench(lambda c=c: gate_up(x_TD, w13, sched, K, c)), c)
                        for c in option_variants(base.gate_up, base.block_m, True)), key=lambda tc: tc[0])
    act_PF = gate_up(x_TD, w13, sched, K, cfg_gu)
    t_dn, cfg_dn = min(((_bench(lambda c=c: down(act_PF, w2, weights_N, sched, c)), c)
                        for c in option_variants(base.down, base.block_m, False)), key=lambda tc: tc[0])
    new = dataclasses.replace(base, gate_up=cfg_gu, down=cfg_dn)
    base_us, new_us = [], []
    if new != base:
        for i in range(rounds):  # the order alternates: on an H200 whichever runs first may meet higher clocks
            for cfg, times in ((base, base_us), (new, new_us))[::1 if i % 2 == 0 else -1]:
                times.append(graph_time_us(lambda c=cfg: fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, c), 20))
    kept = new != base and keep_refined(base_us, new_us, min_gain)
    print(f"  T={T}: gate_up {t_gu:.1f} us {cfg_gu}, down {t_dn:.1f} us {cfg_dn}; whole path base "
          f"{[round(t, 1) for t in base_us]} refined {[round(t, 1) for t in new_us]} us: "
          f"{'kept' if kept else 'base kept' if new != base else 'no change'}", flush=True)
    return base, new, base_us, new_us, kept


def write_table(path: str, table: dict, replace: bool) -> dict:
    """Write the tuned entries; an existing file keeps its other token counts unless replace."""
    merged = {}
    if not replace and os.path.exists(path):
        with open(path) as f:
            merged = json.load(f)
    merged.update(table)
    merged = {key: merged[key] for key in sorted(merged, key=int)}
    with open(path, "w") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")
    fused_moe_config.load_configs.cache_clear()  # a later get_config in this process reads the new file
    return merged


def parse_tokens(text: str):
    """--tokens: positive token counts, comma separated; a clear error otherwise."""
    parts = text.split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"--tokens: {text!r} must be positive token counts separated by commas, e.g. 2048,8192")
    return [int(p) for p in parts]


def parse_shape(name: str):
    """(E, K, D, F) of a named shape (MODEL_SHAPES) or of "E:K:D:F" (local experts, top-k, hidden, expert
    intermediate) for another model; a clear error otherwise."""
    if name in MODEL_SHAPES:
        return MODEL_SHAPES[name]
    parts = name.split(":")
    if len(parts) == 4 and all(p.isdigit() and int(p) > 0 for p in parts):
        return tuple(int(p) for p in parts)
    raise SystemExit(f"--shapes: {name!r} is neither one of {sorted(MODEL_SHAPES)} nor E:K:D:F (e.g. 64:8:2048:1024)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(MODEL_SHAPES),
                        help="comma list of named shapes or E:K:D:F (local experts, top-k, hidden, intermediate)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKEN_COUNTS)))
    parser.add_argument("--out-dir", default=CONFIG_DIR)
    parser.add_argument("--persistent", action="store_true", help="also try persistent GEMMs at BLOCK_M >= 64")
    parser.add_argument("--one-dot", action="store_true", help="also try gate_up as one dot (GemmConfig.one_dot)")
    parser.add_argument("--refine", action="store_true",
                        help="from the config in use, toggle only the options (one dot, persistent, flatten, warp specialisation)")
    parser.add_argument("--min-gain", type=float, default=0.02, help="--refine: the whole path's gain in each round")
    parser.add_argument("--replace", action="store_true", help="write only the token counts tuned now")
    parser.add_argument("--format", default="bf16", choices=("bf16",) + W4_FORMATS + (FP8_FORMAT,),
                        help="the experts' weight format (4-bit: the W4A16 kernels; fp8_w8a8: the W8A8 kernels)")
    args = parser.parse_args()
    if args.format != "bf16" and (args.refine or args.persistent or args.one_dot):
        kernels = "W8A8" if args.format == FP8_FORMAT else "W4A16"
        raise SystemExit(f"--format: the {kernels} kernels have no --refine / --persistent / --one-dot options")
    if not 0.0 <= args.min_gain < 1.0:
        raise SystemExit(f"--min-gain: {args.min_gain} must be a fraction in [0, 1), e.g. 0.02 for 2 %")
    tokens = parse_tokens(args.tokens)
    shapes = [(name, parse_shape(name)) for name in args.shapes.split(",")]  # a typo fails before any tuning
    os.makedirs(args.out_dir, exist_ok=True)
    for name, (E, K, D, F) in shapes:
        if args.format == FP8_FORMAT:
            if D % FP8_BLOCK or F % FP8_BLOCK:
                raise SystemExit(f"--format {FP8_FORMAT}: D={D} and F={F} must be multiples of {FP8_BLOCK}")
            w13, w2 = fp8_weights(E, D, F)
        else:
            w13, w2 = make_weights(E, D, F) if args.format == "bf16" else w4_weights(args.format, E, D, F)
        table, t0 = {}, time.time()
        for T in tokens:
            if args.format == FP8_FORMAT:
                total_us, cfg = tune_fp8_point(T, E, K, D, F, w13, w2)
                table[str(T)] = cfg.to_dict()
                print(f"{name} {args.format} T={T}: {total_us:.1f} us with {cfg}", flush=True)
                continue
            if args.format != "bf16":
                total_us, cfg = tune_w4_point(T, E, K, D, F, args.format, w13, w2)
                table[str(T)] = cfg.to_dict()
                print(f"{name} {args.format} T={T}: {total_us:.1f} us with {cfg}", flush=True)
                continue
            if args.refine:
                base, new, _, _, kept = refine_point(T, E, K, D, F, w13, w2, args.min_gain)
                table[str(T)] = (new if kept else base).to_dict()
                print(f"{name} T={T}: {'refined' if kept else 'unchanged'}", flush=True)
                continue
            total_us, cfg = tune_point(T, E, K, D, F, w13, w2, args.persistent, args.one_dot)
            table[str(T)] = cfg.to_dict()
            print(f"{name} T={T}: {total_us:.1f} us with {cfg}", flush=True)
        path = os.path.join(args.out_dir, config_file_name(E, F, D, args.format, device_name()))
        if args.refine and not args.replace and not os.path.exists(path):  # --out-dir elsewhere: the whole table
            committed = load_configs(E, F, D, "bf16", device_name()) or {}
            table = {**{str(key): cfg.to_dict() for key, cfg in committed.items()}, **table}
        merged = write_table(path, table, args.replace)
        print(f"wrote {path}: {len(table)} entries tuned, {len(merged) - len(table)} kept ({time.time() - t0:.0f} s)",
              flush=True)
        del w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
