"""The lab's figures (matplotlib, the `lab` extra), each saved as a PNG next to its results.

    load_heatmap            expert load per layer, relative to the layer's mean
    capacity_curves         capacity factor vs dropped share, KL and top-1 agreement, per policy
    imbalance_vs_replicas   EPLB: GPU imbalance against the replicas' memory, per trace and GPU count
    step_time_vs_gpus       simulated MoE step time (and straggler share) against the GPU count, per policy
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional

import numpy as np


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plt():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("the lab's plots need matplotlib: pip install 'moe_infer[lab]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_heatmap(load_LE: np.ndarray, path: str, title: str, layer_ids: Optional[List[int]] = None) -> str:
    plt = _plt()
    load_LE = np.asarray(load_LE, dtype=np.float64)
    rel_LE = load_LE / np.maximum(load_LE.mean(1, keepdims=True), 1e-30)
    L, E = rel_LE.shape
    fig, ax = plt.subplots(figsize=(min(max(6.0, 2 + 0.09 * E), 16), 1.6 + 0.35 * L))
    im = ax.imshow(rel_LE, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(L), [str(i) for i in (layer_ids or range(L))])
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="load / layer mean")
    return _save(plt, fig, path)


POLICY_STYLE = {  # (policy, drop_by) -> (colour, marker): the policies differ in colour and marker
    ("drop", "position"): ("tab:blue", "o"), ("drop", "score"): ("tab:orange", "s"),
    ("reroute", "position"): ("tab:green", "^"), ("reroute", "score"): ("tab:red", "v"),
}


def _log_ticks(ax, values) -> None:
    """A log y axis with ticks at 1, 2 and 5 of each decade, labelled as plain numbers (a range of one or two
    decades otherwise shows a single labelled tick); symlog where some value is 0."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    positive = [v for v in values if v > 0]
    if len(positive) < len(values) or not positive:
        ax.set_yscale("symlog", linthresh=max(min(positive, default=1e-3), 1e-6))
        return
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def capacity_figure(rows: List[Dict]):
    """The capacity-factor sweep's figure: one panel per measure, one line per (policy, drop_by, min_capacity).
    Lines that coincide (min_capacity 4 and 192 give the same rows from capacity factor 0.75 on) stay
    distinguishable: colour and marker name the policy, solid / dashed and filled / open the min_capacity."""
    plt = _plt()
    groups: Dict[tuple, List[Dict]] = defaultdict(list)
    for r in rows:
        groups[(r["policy"], r["drop_by"], int(r["min_capacity"]))].append(r)
    mins = sorted({k[2] for k in groups})
    panels = (("dropped_frac", "dropped rows (share)"), ("rerouted_frac", "rerouted rows (share)"),
              ("kl", "KL(dropless || policy), nats"), ("top1_agreement", "top-1 agreement with dropless"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for (policy, drop_by, min_cap), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["capacity_factor"])
        colour, marker = POLICY_STYLE.get((policy, drop_by), (None, "D"))
        second = mins.index(min_cap) % 2 == 1
        style = dict(color=colour, marker=marker, ls="--" if second else "-", lw=1.2 if second else 2.0,
                     ms=8 if second else 5, mfc="none" if second else colour, zorder=2 if second else 3,
                     label=f"{policy} / {drop_by} / min {min_cap}")
        x = [r["capacity_factor"] for r in rs]
        for ax, (key, _) in zip(axes, panels):
            ax.plot(x, [r[key] for r in rs], **style)
    for ax, (key, name) in zip(axes, panels):
        ax.set_xlabel("capacity factor")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        if key == "kl":
            _log_ticks(ax, [r["kl"] for r in rows])
    axes[0].legend(fontsize=7)
    return fig


def capacity_curves(rows: List[Dict], path: str) -> str:
    """rows: the CF sweep table (policy, drop_by, min_capacity, capacity_factor, dropped_frac, kl, top1_agreement)."""
    return _save(_plt(), capacity_figure(rows), path)


def imbalance_figure(rows: List[Dict], target: float = 0.10, target_memory: float = 0.10):
    """rows: the EPLB table (trace, num_gpus, memory_overhead, imbalance_mean, planner). Axis limits leave room
    around every point (a point on the frame's edge, such as 256 GPUs at +1500 % memory, is not cut)."""
    plt = _plt()
    traces = sorted({r["trace"] for r in rows})
    fig, axes = plt.subplots(1, len(traces), figsize=(4.6 * len(traces), 3.8), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        by_n: Dict[int, List[Dict]] = defaultdict(list)
        for r in rows:
            if r["trace"] == trace and r["planner"] == "eplb":
                by_n[r["num_gpus"]].append(r)
        xs, ys = [100 * target_memory], [target]
        for n, rs in sorted(by_n.items()):
            rs = sorted(rs, key=lambda r: r["memory_overhead"])
            x = [100 * r["memory_overhead"] for r in rs]
            y = [max(r["imbalance_mean"], 1e-3) for r in rs]
            ax.plot(x, y, marker="o", label=f"{n} GPUs")
            xs += x
            ys += y
        ax.axhline(target, color="k", ls="--", lw=0.8)
        ax.axvline(100 * target_memory, color="k", ls=":", lw=0.8)
        _log_ticks(ax, ys)
        ax.set_ylim(min(ys) / 2, max(ys) * 2)  # a factor of 2 either way: a marker's width on a log axis
        pad = 0.06 * (max(xs) - min(min(xs), 0)) + 1
        ax.set_xlim(min(min(xs), 0) - pad, max(xs) + pad)
        ax.set_xlabel("replica memory (% of expert memory)")
        ax.set_ylabel("GPU imbalance (max-mean)/mean")
        ax.set_title(trace, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def imbalance_vs_replicas(rows: List[Dict], path: str, target: float = 0.10, target_memory: float = 0.10) -> str:
    return _save(_plt(), imbalance_figure(rows, target, target_memory), path)


def step_time_vs_gpus(rows: List[Dict], path: str) -> str:
    """rows: the simulation table (trace, policy, num_gpus, step_us, straggler_share)."""
    plt = _plt()
    traces = sorted({r["trace"] for r in rows})
    fig, axes = plt.subplots(2, len(traces), figsize=(4.8 * len(traces), 6.4), squeeze=False)
    for col, trace in enumerate(traces):
        by_policy: Dict[str, List[Dict]] = defaultdict(list)
        for r in rows:
            if r["trace"] == trace:
                by_policy[r["policy"]].append(r)
        for policy, rs in sorted(by_policy.items()):
            rs = sorted(rs, key=lambda r: r["num_gpus"])
            n = [r["num_gpus"] for r in rs]
            axes[0, col].plot(n, [r["step_us"] / 1e3 for r in rs], marker="o", label=policy)
            axes[1, col].plot(n, [r["straggler_share"] for r in rs], marker="o", label=policy)
        for row, name in ((0, "MoE step time (ms)"), (1, "straggler share")):
            ax = axes[row, col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("GPUs")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        axes[0, col].set_title(trace, fontsize=10)
        axes[0, col].legend(fontsize=7)
    return _save(plt, fig, path)
