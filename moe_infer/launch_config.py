"""The main job's typed config: EngineConfig's groups plus sampling and the prompts.

Registered in Hydra's ConfigStore as `job_schema`; conf/config.yaml lists it first in its defaults, so
every composed config is checked against these dataclasses (unknown key or wrong type -> error). A key added
with `+key=value` passes Hydra's check (adding keys is what `+` is for) and OmegaConf.to_object keeps it as a
stray attribute: `to_job` refuses it.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from moe_infer.config import EngineConfig
from moe_infer.server.config import ServeConfig
from moe_infer.experiments.config import TASK_NAMES, LabConfig

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")  # package data: ships with `pip install .`


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    logprobs: Optional[int] = None


@dataclass
class JobConfig(EngineConfig):
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompts: List[str] = field(default_factory=lambda: ["def fibonacci(n):"])
    prompt: Optional[str] = None  # a single prompt from the command line: replaces `prompts`
    prompt_file: Optional[str] = None  # a file whose text is the one prompt ("-": stdin): replaces `prompts`
    show_expert_load: bool = True
    show_progress: bool = True  # vLLM's progress bar (finished requests, input/output tokens/s) on stderr
    serve: ServeConfig = field(default_factory=ServeConfig)  # `moe-infer serve` (the OpenAI server)
    trace_out: Optional[str] = None  # write the run's routing trace here (turns routing.trace on)
    task: str = "generate"  # generate | a lab task (moe_infer.experiments): record_trace, cf_sweep, eplb, ...
    lab: LabConfig = field(default_factory=LabConfig)

    def __post_init__(self) -> None:
        if self.task not in TASK_NAMES:
            raise ValueError(f"task={self.task!r} is not one of {', '.join(TASK_NAMES)}")
        if self.prompt is not None and self.prompt_file is not None:
            raise ValueError("prompt and prompt_file are both set: give one")
        if self.prompt_file not in (None, "-") and not os.path.isfile(self.prompt_file):
            raise ValueError(f"prompt_file={self.prompt_file!r}: no such file")
        if self.task == "generate" and self.prompt is None and self.prompt_file is None and not self.prompts:
            raise ValueError("prompts is empty: give at least one prompt (prompts='[\"a\", \"b\"]', prompt=... "
                             "or prompt_file=...)")

    def engine_config(self) -> EngineConfig:
        routing = dataclasses.replace(self.routing, trace=True) if self.trace_out else self.routing
        return EngineConfig(
            model=self.model, cache=self.cache, scheduler=self.scheduler, routing=routing,
            experts=self.experts, offload=self.offload, parallel=self.parallel, seed=self.seed,
            speculative=self.speculative,
        )

    def prompt_list(self) -> List[str]:
        """The prompts to run. prompt_file is read here (stdin for "-"), its one trailing newline dropped (what
        `echo` and editors add); a prompt with shell or Hydra syntax in it ("def f(x):") needs no quoting there."""
        if self.prompt_file is not None:
            if self.prompt_file == "-":
                text = sys.stdin.read()
            else:
                with open(self.prompt_file, encoding="utf-8") as f:
                    text = f.read()
            return [text.removesuffix("\n")]
        return [self.prompt] if self.prompt is not None else list(self.prompts)


def unknown_keys(cfg: DictConfig, prefix: str = "") -> List[str]:
    """Dotted keys of cfg that no field of its dataclass declares (free-form dict nodes take any key)."""
    cls = OmegaConf.get_type(cfg)
    known = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else None
    out: List[str] = []
    for key in cfg:
        if known is not None and key not in known:
            out.append(f"{prefix}{key}")
            continue
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
            out += unknown_keys(node, f"{prefix}{key}.")
    return out


def to_job(cfg: DictConfig) -> JobConfig:
    """The composed Hydra config as a JobConfig; ValueError naming any key the schema does not have."""
    unknown = unknown_keys(cfg)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}: the job has no such setting (a key added with `+` is "
                         f"still checked; see moe_infer/launch_config.py and moe_infer/config.py for the names)")
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig)
    return job


ConfigStore.instance().store(name="job_schema", node=JobConfig)
