"""Tables, targets and the measured overlap threshold of the expert-parallel benchmark (rank 0)."""
from __future__ import annotations

from typing import List, Optional

COLS = ("route", "dispatch", "dispatch_steps", "dispatch_mb2", "dispatch_mb4", "experts", "combine", "layer",
        "layer_overlap", "layer_overlap4", "all_gather", "raw_a2a")
HEAD = ("route", "disp", "d_steps", "d_mb2", "d_mb4", "experts", "comb", "layer", "ovl2", "ovl4", "gather", "raw")
OVERLAPS = ("layer_overlap", "layer_overlap4")


def _fmt(v: Optional[float]) -> str:
    return f"{v:>8.0f}" if v is not None else f"{'-':>8}"


def _timing(row: dict) -> tuple:
    """(mode, times) the targets are judged on: graph replay where measured, else eager."""
    g = row["graph_us"]
    if g.get("layer") is not None:
        return "graph", g
    return "eager", row["eager_us"]


def targets(rows: List[dict]) -> List[dict]:
    out = []
    for r in rows:
        if r["backend"] == "local":
            continue
        mode, t = _timing(r)
        checks = []
        raw = t.get("raw_a2a")
        if r["backend"] == "capacity" and raw:
            checks += [("dispatch<=1.15raw", t.get("dispatch"), raw), ("combine<=1.15raw", t.get("combine"), raw)]
        overlaps = {k: t[k] for k in OVERLAPS if t.get(k) is not None}
        if r["tokens_per_rank"] == 4096 and raw and t.get("experts") is not None and overlaps:
            best = min(overlaps, key=overlaps.get)
            checks.append((f"overlap<=1.15bound[{best}]", overlaps[best], max(2 * raw, t["experts"])))
        for name, value, bound in checks:
            ratio = value / bound if value is not None else None
            out.append({"model": r["model"], "T": r["tokens_per_rank"], "backend": r["backend"], "ep": r["ep"],
                        "target": name, "timing": mode, "ratio": ratio,
                        "pass": ratio is not None and ratio <= 1.15})
    return out


def overlap_threshold_mb(rows: List[dict], stage: str = "layer_overlap", reduce: bool = False) -> Optional[float]:
    """Smallest payload (MB, as in `parallel.overlap_min_mb`: the all-to-all backends' dispatch, T*K*D
    elements; reduce=True: the reduce backend's all-reduce, ep*T*D) from which overlap (`stage`) beat
    no overlap at every larger measured payload; None if it never did."""
    pts = []
    for r in rows:
        if r["backend"] == "local" or (r["backend"] == "reduce") != reduce:
            continue
        _, t = _timing(r)
        if t.get("layer") is None or t.get(stage) is None:
            continue
        elements = r["ep"] * r["tokens_per_rank"] * r["D"] if reduce else r["tokens_per_rank"] * r["K"] * r["D"]
        mb = elements * 2 / 1e6
        pts.append((mb, t[stage] < t["layer"]))
    pts.sort()
    threshold = None
    for mb, helps in reversed(pts):
        if not helps:
            break
        threshold = mb
    return threshold


def print_report(rows: List[dict], world: int, device: str) -> dict:
    for mode in ("graph", "eager"):
        print(f"EP={world} on {world} x {device}: {mode} us per MoE layer (max over ranks)")
        print(f"{'model':<14}{'T':>5} {'backend':<9}" + "".join(f"{h:>8}" for h in HEAD))
        for r in rows:
            t = r[f"{mode}_us"]
            if not t:
                continue
            print(f"{r['model'][:13]:<14}{r['tokens_per_rank']:>5} {r['backend']:<9}" + "".join(_fmt(t.get(c)) for c in COLS))
    result = {"targets": targets(rows), "overlap_threshold_mb": overlap_threshold_mb(rows),
              "overlap4_threshold_mb": overlap_threshold_mb(rows, "layer_overlap4"),
              "reduce_overlap_threshold_mb": overlap_threshold_mb(rows, reduce=True),
              "reduce_overlap4_threshold_mb": overlap_threshold_mb(rows, "layer_overlap4", reduce=True)}
    for c in result["targets"]:
        ratio = "n/a" if c["ratio"] is None else f"{c['ratio']:.2f}"
        print(f"target ep={c['ep']} {c['model']} T={c['T']} {c['backend']} {c['target']} ({c['timing']}): {ratio} "
              f"{'PASS' if c['pass'] else 'FAIL'}")
    print(f"overlap helps from {result['overlap_threshold_mb']} MB of dispatch payload with 2 micro-batches, "
          f"from {result['overlap4_threshold_mb']} MB with 4 (None: never)")
    print(f"reduce: overlap helps from {result['reduce_overlap_threshold_mb']} MB of all-reduce payload with 2 token "
          f"chunks, from {result['reduce_overlap4_threshold_mb']} MB with 4 (None: never)")
    for r in rows:
        for e in r.get("errors", []):
            print(f"error {r['model']} T={r['tokens_per_rank']} {r['backend']}: {e}")
    return result
