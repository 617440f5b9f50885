"""The offload knobs: Hydra group options, LLM(...) keywords, and clear errors for bad values."""
from __future__ import annotations

import pytest

from moe_infer.config import OffloadConfig
from moe_infer.engine.llm import build_config


def test_llm_keywords_as_the_issue_writes_them():
    cfg = build_config(offload="cpu", gpu_expert_budget_gb=20, cache_policy="lfu", miss_policy="wait")
    assert cfg.offload == OffloadConfig(store="cpu", gpu_expert_budget_gb=20, cache_policy="lfu", miss_policy="wait")
    assert build_config(policy="drop").routing.policy == "drop"  # routing's `policy` keeps its short name


@pytest.mark.parametrize("kwargs,match", [
    (dict(store="cpu", gpu_expert_budget_gb=0), "gpu_expert_budget_gb must be positive"),
    (dict(store="cpu", gpu_expert_budget_gb=1, slots_per_layer=2), "not both"),
    (dict(store="cpu", miss_policy="sometimes"), "miss_policy must be auto, share, wait or cpu"),
    (dict(store="cpu", stream_fraction=0), r"stream_fraction must be in \(0, 1\]"),
    (dict(store="cpu", prefetch_stats_weight=2), r"prefetch_stats_weight must be in \[0, 1\]"),
    (dict(store="cpu", prefetch_min_prob=1.5), r"prefetch_min_prob must be in \[0, 1\]"),
    (dict(store="nvme", nvme_path="/x", nvme_reader="mmap"), "nvme_reader must be auto, deepspeed or threads"),
])
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffloadConfig(**kwargs)


def test_unknown_store_names_the_field():
    from moe_infer import LLM

    with pytest.raises(KeyError, match="offload.store='gpu' is not a registered expert store; available: cpu, nvme, resident"):
        LLM(device="cpu", offload="gpu")


def test_impossible_budget_fails_at_start_up():
    from moe_infer import LLM

    with pytest.raises(ValueError, match=r"gpu_expert_budget_gb=1e-05 holds 0 experts.*at least 2"):
        LLM(device="cpu", offload="cpu", gpu_expert_budget_gb=1e-5)


def test_hydra_nvme_needs_a_path():
    pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    from moe_infer.launch import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        with pytest.raises((MissingMandatoryValue, ValueError), match="offload.nvme_path"):
            OmegaConf.to_object(compose(config_name="config", overrides=["offload=nvme"]))
        job = OmegaConf.to_object(compose(config_name="config", overrides=[
            "offload=cpu", "offload.slots_per_layer=2", "offload.prefetch_rule=all", "offload.prefetch_min_prob=0.5"]))
    assert job.offload.store == "cpu" and job.offload.slots_per_layer == 2
    assert job.offload.prefetch_rule == "all" and job.offload.prefetch_min_prob == 0.5
