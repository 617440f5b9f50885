"""Shared pieces of the lab tasks: where results go, trace inputs by name, held-out windows."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import List, NamedTuple, Optional

import numpy as np

from moe_infer.experiments.config import LabConfig
from moe_infer.lab.loads import expert_load, load_from_stats
from moe_infer.lab.synthetic import SyntheticSpec, generate
from moe_infer.routing.trace import RoutingTrace, load_trace

EXAMPLE_TRACE = Path(__file__).resolve().parents[1] / "assets" / "traces" / "tiny_moe_heldout.safetensors"
REPO_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def out_dir(lab: LabConfig) -> str:
    """lab.out_dir, else the running Hydra job's output folder, else the working directory (created)."""
    path = lab.out_dir
    if path is None:
        try:
            from hydra.core.hydra_config import HydraConfig

            path = HydraConfig.get().runtime.output_dir
        except (ImportError, ValueError):  # not under a Hydra run
            path = os.getcwd()
    os.makedirs(path, exist_ok=True)
    return path


class TraceInput(NamedTuple):
    label: str
    trace: Optional[RoutingTrace]  # None for load statistics
    load_LE: Optional[np.ndarray]  # statistics only (a trace's load comes from the trace)
    layer_ids: List[int]  # the model's layer index of each MoE layer


def trace_input(name: str, synthetic: SyntheticSpec) -> TraceInput:
    """A `lab.traces` entry, loaded."""
    if name == "example":
        if not EXAMPLE_TRACE.is_file():
            raise FileNotFoundError(f"the example trace {EXAMPLE_TRACE} is missing (package data not installed?)")
        trace = load_trace(str(EXAMPLE_TRACE))
        return TraceInput("tiny_moe", trace, None, trace.moe_layers)
    if name.startswith("synthetic:"):
        spec = dataclasses.replace(synthetic, pattern=name.split(":", 1)[1])
        spec.__post_init__()
        trace = generate(spec)
        return TraceInput(f"synthetic_{spec.pattern}", trace, None, trace.moe_layers)
    if name.startswith("stats:"):
        path = name.split(":", 1)[1]
        with open(path) as f:
            rows = json.load(f)
        load_LE = load_from_stats(rows)
        return TraceInput(Path(path).stem, None, load_LE, [int(r.get("layer", i)) for i, r in enumerate(rows)])
    trace = load_trace(name)
    return TraceInput(Path(name).stem, trace, None, trace.moe_layers)


def split_load(trace: Optional[RoutingTrace], load_LE: Optional[np.ndarray], fraction: float):
    """(plan load, evaluation load): a trace's first `fraction` of tokens and the rest; statistics
    without a trace are planned and evaluated on the same load (stated in the results)."""
    if trace is None:
        return load_LE, load_LE
    cut = max(1, min(trace.num_tokens - 1, int(round(fraction * trace.num_tokens))))
    return expert_load(trace, 0, cut), expert_load(trace, cut)


def heldout_windows(job, tokenizer) -> np.ndarray:
    """The held-out windows of `lab.data` as token ids [num_windows, seq_len]."""
    from moe_infer.experiments import heldout

    data = job.lab.data
    docs = heldout.stdlib_validation() if data.source == "stdlib_val" else heldout.text_path(data.path)
    return heldout.token_windows(tokenizer, docs, data.seq_len, data.num_windows)


def model_path(job) -> str:
    if job.model.path:
        return job.model.path
    from moe_infer.assets import default_model_path

    return default_model_path()


def write_run_info(out: str, job, **extra) -> dict:
    """`run.json` in the output folder: the code's commit, versions and the job's lab config."""
    import platform
    import time

    import torch

    from moe_infer.lab.tables import write_json
    from moe_infer.routing.trace import source_commit

    info = {"task": job.task, "commit": source_commit(), "python": platform.python_version(),
            "torch": torch.__version__, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
            "routing": dataclasses.asdict(job.routing), "lab": dataclasses.asdict(job.lab), **extra}
    write_json(os.path.join(out, "run.json"), info)
    return info


def print_written(task: str, out: str) -> str:
    """Say where a task's results went: its folder and what is in it (files, and folders with a slash)."""
    names = sorted(n + ("/" if os.path.isdir(os.path.join(out, n)) else "") for n in os.listdir(out)
                   if not n.startswith("."))
    line = f"{task} -> {os.path.abspath(out)}: {', '.join(names)}"
    print(line, flush=True)
    return line
