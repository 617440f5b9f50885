"""The lab's figures on the committed sweep and EPLB tables: coinciding lines stay apart, the KL axis has ticks to
read, and no point sits on (or past) the frame."""
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the lab's figures need matplotlib (the lab extra)")

from moe_infer.lab import plots  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "load_balance"


def _style(line):
    return (line.get_linestyle(), line.get_marker(), str(line.get_markerfacecolor()), line.get_color())


def test_capacity_curves_tell_coinciding_lines_apart_and_label_the_log_axis():
    import matplotlib.pyplot as plt

    rows = json.loads((RESULTS / "cf_sweep" / "cf_sweep.json").read_text())
    fig = plots.capacity_figure(rows)
    try:
        dropped, _, kl, _ = fig.axes[:4]
        lines = dropped.get_lines()
        assert len(lines) == len({(r["policy"], r["drop_by"], r["min_capacity"]) for r in rows})
        assert len({_style(ln) for ln in lines}) == len(lines)  # min 4 and 192 coincide from cf 0.75 on
        fig.canvas.draw()
        low, high = kl.get_ylim()
        labels = [t for t in kl.get_yticklabels() if t.get_text() and low <= t.get_position()[1] <= high]
        assert len(labels) >= 3, [t.get_text() for t in labels]
    finally:
        plt.close(fig)


def test_eplb_figure_keeps_every_point_inside_the_frame():
    import matplotlib.pyplot as plt

    rows = json.loads((RESULTS / "eplb" / "eplb.json").read_text())
    assert max(r["memory_overhead"] for r in rows if r["planner"] == "eplb") >= 15  # the +1500 % point of 256 GPUs
    fig = plots.imbalance_figure(rows)
    try:
        for ax in fig.axes:
            (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
            for line in ax.get_lines():
                if not line.get_marker() or line.get_marker() == "None":
                    continue  # the target lines
                for x, y in zip(line.get_xdata(), line.get_ydata()):
                    assert x0 < x < x1 and y0 < y < y1, (ax.get_title(), x, y, (x0, x1), (y0, y1))
                    assert y * 1.3 < y1 and y / 1.3 > y0, (ax.get_title(), y, (y0, y1))  # room for the marker
    finally:
        plt.close(fig)
