"""Hydra callback: at the end of a `cf_sweep` multirun, one table, figure and report for the sweep.

Named in the experiment config (`hydra.callbacks.sweep_table._target_`); every job of the sweep
left its row in `<sweep dir>/<job number>/result.json`.
"""
from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from moe_infer.experiments.cf_sweep import finish_sweep
        from moe_infer.lab.tables import collect_rows

        sweep_dir = config.hydra.sweep.dir
        rows = collect_rows(sweep_dir)
        if not rows:
            print(f"sweep table: no job of {sweep_dir} left a result.json")
            return
        finish_sweep(rows, sweep_dir)
        print(f"sweep table: {len(rows)} runs -> {sweep_dir}/cf_sweep.csv, cf_sweep.json, cf_curves.png, report.md")
