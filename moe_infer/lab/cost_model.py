"""Step-time model of an MoE layer on a GPU cluster, calibrated from this project's benchmark JSONs.

Pieces (times in microseconds, per MoE layer, per GPU g; the layer takes the slowest GPU of each
collective phase, see `simulate`):
  experts   t = c0 + A * h(R / A): A experts with rows on g, R rows on g. c0 is the fixed cost of
            the expert kernels (launches, schedule), h the time per active expert as a function
            of its rows: piecewise linear through the measured points, flat below the first, on
            the last segment's slope above the last. Calibrated on uniform routing, where
            T tokens over E experts give A = E (1 - (1 - K/E)^T) active experts (expected) and
            R = T K rows. Two curves: `local` (one GPU: the fused path on all tokens,
            fused_moe_<device>.json + expert_parallel_*_ep1.json) and `ep` (the experts run on an
            EP rank's received buffer, expert_parallel_*_ep2.json): the EP path is slower per row.
  all-to-all  t = alpha + max(out, in bytes over NVLink) / bw_nvlink, inter-node bytes at the
            network's bandwidth in parallel (`network`: an assumption, no multi-node benchmark).
            alpha and bw_nvlink: least squares on the 2-GPU raw all_to_all_single times.
  dispatch / combine  = factor x the all-to-all of their payload (packing, the top-k sum): the
            median measured ratio on 2 GPUs.
  route     the median measured gate + top-k time (the same on every GPU).

Legend: E experts, K top-k, D hidden, F expert intermediate, T tokens, A active experts, R rows.
"""
from __future__ import annotations

import glob
import itertools
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Sequence, Tuple

import numpy as np

BF16_BYTES = 2
WEIGHT_BYTES = 4  # each dispatched row carries its float32 routing weight


def expected_active(num_experts: int, top_k: int, num_tokens, num_slots=None):
    """Expected experts (of num_slots, default all) with at least one row when T tokens route uniformly."""
    slots = num_experts if num_slots is None else num_slots
    return slots * (1.0 - (1.0 - top_k / num_experts) ** np.asarray(num_tokens, dtype=np.float64))


@dataclass
class ExpertCurve:
    c0_us: float
    rows: List[float]  # rows per active expert, ascending
    per_expert_us: List[float]  # h at those rows

    def time_us(self, active_G, rows_G) -> np.ndarray:
        A = np.asarray(active_G, dtype=np.float64)
        R = np.asarray(rows_G, dtype=np.float64)
        r = np.divide(R, A, out=np.zeros_like(R), where=A > 0)
        x, y = np.asarray(self.rows), np.asarray(self.per_expert_us)
        slope = (y[-1] - y[-2]) / (x[-1] - x[-2]) if len(x) > 1 else 0.0
        h = np.where(r > x[-1], y[-1] + slope * (r - x[-1]), np.interp(r, x, y))
        return self.c0_us + A * h


def fit_curve(points: Sequence[Tuple[float, float, float]], c0_fallback: float = 0.0) -> ExpertCurve:
    """ExpertCurve through (A, R, t_us) points: c0 from a non-negative least-squares fit of
    t = c0 + c1 A + c2 R (relative error), capped at 0.9 x the fastest point; then h = (t - c0) / A.
    Where A hardly varies (< 1.5x: every point has all experts active) c0 cannot be told from c1 A,
    and c0_fallback is used instead."""
    P = np.asarray(points, dtype=np.float64)
    A, R, t = P[:, 0], P[:, 1], P[:, 2]
    if A.max() < 1.5 * A.min():
        return _curve(A, R, t, min(c0_fallback, 0.9 * t.min()))
    X, w = np.stack([np.ones_like(A), A, R], 1), 1.0 / t
    best = None
    for cols in itertools.chain.from_iterable(itertools.combinations(range(3), n) for n in (1, 2, 3)):
        c, *_ = np.linalg.lstsq(X[:, cols] * w[:, None], t * w, rcond=None)
        if (c < 0).any():
            continue
        full = np.zeros(3)
        full[list(cols)] = c
        err = float(np.abs((X @ full - t) * w).max())
        if best is None or err < best[0]:
            best = (err, full)
    return _curve(A, R, t, min(best[1][0], 0.9 * t.min()))


def _curve(A: np.ndarray, R: np.ndarray, t: np.ndarray, c0: float) -> ExpertCurve:
    r, h = R / A, (t - c0) / A
    order = np.argsort(r, kind="stable")
    rows, per = [], []
    for i in order:  # equal rows (the same T measured twice): average
        if rows and abs(r[i] - rows[-1]) < 1e-9 * max(r[i], 1.0):
            per[-1] = (per[-1] + h[i]) / 2
        else:
            rows.append(float(r[i]))
            per.append(float(h[i]))
    return ExpertCurve(float(c0), rows, per)


@dataclass
class LinkCost:
    alpha_us: float
    bytes_per_us: float

    def time_us(self, num_bytes) -> np.ndarray:
        b = np.asarray(num_bytes, dtype=np.float64)
        return np.where(b > 0, self.alpha_us + b / self.bytes_per_us, 0.0)


@dataclass
class CostModel:
    shape: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    device: str
    local: ExpertCurve
    ep: ExpertCurve
    nvlink: LinkCost
    network: LinkCost
    dispatch_factor: float
    combine_factor: float
    route_us: float
    gpus_per_node: int = 8
    sources: List[str] = field(default_factory=list)
    assumptions: List[str] = field(default_factory=list)

    @property
    def row_bytes(self) -> int:
        return self.hidden * BF16_BYTES + WEIGHT_BYTES

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.intermediate * BF16_BYTES

    def a2a_us(self, intra_out, intra_in, inter_out, inter_in) -> np.ndarray:
        """Per GPU: NVLink and network transfers run side by side; each link's time is the larger
        of its send and receive volume."""
        nv = self.nvlink.time_us(np.maximum(intra_out, intra_in))
        net = self.network.time_us(np.maximum(inter_out, inter_in))
        return np.maximum(nv, net)

    def to_json(self) -> Dict:
        return asdict(self)


def read_results(results_dir: str, pattern: str) -> List[Tuple[str, dict]]:
    paths = sorted(glob.glob(os.path.join(results_dir, pattern)))
    return [(os.path.basename(p), json.load(open(p))) for p in paths]


def calibrate(results_dir: str, shape: str = "qwen3-30b-a3b", device: str = "H200",
              network_gbps: float = 400.0, network_alpha_us: float = 20.0, gpus_per_node: int = 8,
              calibration_ep: int = 2) -> CostModel:
    """The cost model of `shape` on `device` (a substring of the JSONs' device names). The all-to-all and
    the dispatch/combine factors are fitted on the EP=`calibration_ep` runs only, so that the other EP
    sizes check the model (`calibration_check`); the EP expert curve uses every EP size."""
    dev_tag = device.lower()
    local_pts, ep_pts, a2a_pts, ratios_d, ratios_c, routes, sources = [], [], [], [], [], [], []
    dims = None
    for name, data in read_results(results_dir, "fused_moe_*.json"):
        if dev_tag not in data.get("device", "").lower() or "trial" in name or "variants" in name:
            continue
        for p in data.get("points", []):
            if p.get("shape") == shape and p.get("ours_us"):
                dims = (p["E"], p["K"], p["D"], p["F"])
                A = float(expected_active(p["E"], p["K"], p["tokens"]))
                local_pts.append((A, p["tokens"] * p["K"], p["ours_us"]))
                sources.append(name)
    for name, data in read_results(results_dir, "expert_parallel_*x*_ep*.json"):
        if dev_tag not in data.get("device", "").lower():
            continue
        for r in data.get("results", []):
            g = r.get("graph_us") or {}
            if r.get("model") != shape:
                continue
            dims = (r["E"], r["K"], r["D"], r["F"])
            ep, T = r["ep"], r["tokens_per_rank"] * r["ep"]  # each rank brings its own tokens
            S = r["E"] // ep
            A = float(expected_active(r["E"], r["K"], T, S))
            if g.get("route"):
                routes.append(g["route"])
            if r["backend"] == "local" and g.get("experts"):
                local_pts.append((A, T * r["K"], g["experts"]))
            elif r["backend"] == "capacity" and g.get("experts"):  # every EP size: S varies, c0 separates
                ep_pts.append((A, T * r["K"] * S / r["E"], g["experts"]))
            if ep == calibration_ep and g.get("raw_a2a"):
                a2a_pts.append((r["payload_bytes"] * (ep - 1) / ep, g["raw_a2a"]))
                if r["backend"] == "capacity" and g.get("dispatch"):
                    ratios_d.append(g["dispatch"] / g["raw_a2a"])
                    ratios_c.append(g["combine"] / g["raw_a2a"])
            sources.append(name)
    if dims is None or len(local_pts) < 2 or len(ep_pts) < 2 or len(a2a_pts) < 2:
        raise ValueError(f"no calibration for shape {shape!r} on {device!r} under {results_dir}: need "
                         f"fused_moe_*.json and expert_parallel_*x*_ep1/ep2.json points (got {len(local_pts)} "
                         f"local, {len(ep_pts)} EP expert and {len(a2a_pts)} all-to-all points)")
    b, t = np.array(a2a_pts).T
    slope, alpha = np.polyfit(b, t, 1)
    E, K, D, F = dims
    ep_curve = fit_curve(ep_pts)
    return CostModel(
        shape=shape, num_experts=E, top_k=K, hidden=D, intermediate=F, device=device,
        local=fit_curve(local_pts, c0_fallback=ep_curve.c0_us), ep=ep_curve,
        nvlink=LinkCost(max(float(alpha), 0.0), 1.0 / float(slope)),
        network=LinkCost(network_alpha_us, network_gbps / 8 * 1e3),  # Gbit/s -> bytes/us
        dispatch_factor=float(np.median(ratios_d)), combine_factor=float(np.median(ratios_c)),
        route_us=float(np.median(routes)) if routes else 0.0, gpus_per_node=gpus_per_node,
        sources=sorted(set(sources)),
        assumptions=[
            f"inter-node all-to-all at {network_gbps:g} Gbit/s per GPU with {network_alpha_us:g} us latency "
            "(assumed: no multi-node benchmark); NVLink and network transfers overlap",
            f"{gpus_per_node} GPUs per node; every GPU of a node reaches the others at the measured 2-GPU NVLink rate",
            "the phases of a layer (route, dispatch, experts, combine) do not overlap; each waits for the slowest GPU",
            "attention and the other non-MoE work are not modelled (the same for every policy)",
        ],
    )
