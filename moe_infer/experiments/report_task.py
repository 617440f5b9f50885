"""Task `report`: one page over the result folders of several lab runs (their section.json files)."""
from __future__ import annotations

from moe_infer.experiments import TASKS
from moe_infer.experiments.common import out_dir
from moe_infer.lab.report import gather


@TASKS.register("report")
def report_task(job) -> str:
    out = out_dir(job.lab)
    if not job.lab.report_dirs:
        raise ValueError("task=report needs lab.report_dirs (result folders with a section.json)")
    path = gather(out, job.lab.report_dirs)
    print(f"report -> {path}")
    return path
