"""The lab's experiment tasks, run by the main job: `python -m moe_infer.launch +experiment=<name>`.

`task=` in the job config picks one (registry `TASKS`); each writes its tables, figures and a
report page into the Hydra output folder (`lab.out_dir` overrides it):

    record_trace     the engine over held-out text with the routing recorder on -> trace + heatmap
    synthetic_trace  a synthetic trace (lab.synthetic) in the same format -> trace + heatmap
    cf_sweep         one capacity-policy run's drops, imbalance and quality cost vs dropless; under
                     --multirun the callback `SweepTable` makes one table + figures per sweep
    eplb             EPLB placements for N GPUs from traces or load statistics: imbalance and memory
    simulate         the traces replayed over 8..1024 GPUs with the calibrated cost model
    report           one page over several result folders (lab.report_dirs)

These modules drive the engine; the arithmetic lives in `moe_infer.lab`, which never imports it.
"""
from __future__ import annotations

from typing import Any, Callable

from moe_infer.registry import Registry

TASKS: Registry[Callable[[Any], Any]] = Registry("lab task")


def run_task(job) -> Any:
    """Run job.task (importing the task modules registers them)."""
    from moe_infer.experiments import cf_sweep, eplb_task, report_task, simulate_task, traces  # noqa: F401

    return TASKS.get(job.task)(job)
