"""Every Hydra config group option and experiment composes into the typed JobConfig."""
import io
import os

import pytest

pytest.importorskip("hydra", reason="the Hydra launcher's configs need hydra-core (not on the lent GPU machines)")

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.errors import ConfigCompositionException  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from moe_infer.config import EngineConfig  # noqa: E402
from moe_infer.launch import CONF_DIR  # noqa: E402
from moe_infer.launch_config import JobConfig, to_job  # noqa: E402

GROUPS = sorted(
    d for d in os.listdir(CONF_DIR) if os.path.isdir(os.path.join(CONF_DIR, d)) and d != "experiment"
)


def _options(group):
    return sorted(f[:-5] for f in os.listdir(os.path.join(CONF_DIR, group)) if f.endswith(".yaml"))


def _compose(overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_groups_cover_engine_config():
    expected = {"model", "cache", "scheduler", "routing", "experts", "offload", "parallel", "sampling", "speculative"}
    assert expected <= set(GROUPS)


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if group == "model" and option == "hf":
        overrides.append("model.path=/some/checkpoint")
    if group == "offload" and option == "nvme":
        overrides.append("offload.nvme_path=/some/nvme/dir")
    if group == "speculative" and option == "draft":
        overrides.append("speculative.draft_model=/some/draft/checkpoint")
    job = OmegaConf.to_object(_compose(overrides))
    assert isinstance(job, JobConfig)
    engine = job.engine_config()
    assert isinstance(engine, EngineConfig)
    assert type(getattr(engine, group, job.sampling)).__name__.endswith("Config")


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment_composes(experiment):
    job = OmegaConf.to_object(_compose([f"+experiment={experiment}"]))
    assert isinstance(job, JobConfig)
    assert job.prompt_list()


def test_experiment_load_balance_sets_capacity_policy():
    job = OmegaConf.to_object(_compose(["+experiment=load_balance"]))
    assert job.routing.policy == "drop" and job.routing.capacity_factor == 1.0


def test_wrong_type_and_unknown_key_fail_with_the_key_name():
    with pytest.raises(ConfigCompositionException, match="block_size"):
        _compose(["cache.block_size=abc"])
    with pytest.raises(ConfigCompositionException, match="routing.foo"):
        _compose(["routing.foo=1"])


def test_model_hf_without_a_path_is_refused():
    with pytest.raises(Exception, match="model.path is empty: model=hf needs model.path="):
        OmegaConf.to_object(_compose(["model=hf"]))


def test_invalid_value_is_rejected_by_the_dataclass():
    with pytest.raises(Exception, match="capacity_factor"):
        OmegaConf.to_object(_compose(["routing.capacity_factor=-1"]))


def test_single_prompt_replaces_list():
    job = OmegaConf.to_object(_compose(["prompt=hello"]))
    assert job.prompt_list() == ["hello"]


@pytest.mark.parametrize("overrides", [[], ["offload=cpu", "parallel=tp"]]
                         + [[f"+experiment={e}"] for e in _options("experiment")])
def test_composed_configs_have_no_unknown_keys(overrides):
    assert isinstance(to_job(_compose(overrides)), JobConfig)


def test_a_key_added_with_plus_is_refused_by_name():
    """`+foo=1` passes Hydra (adding keys is what + does) and OmegaConf.to_object kept it as a stray attribute."""
    with pytest.raises(ValueError, match=r"unknown config keys \['routing.bar', 'foo'\]"):
        to_job(_compose(["+foo=1", "+routing.bar=2"]))


def test_an_empty_prompt_list_is_refused():
    with pytest.raises(ValueError, match="prompts is empty"):
        to_job(_compose(["prompts=[]"]))
    assert to_job(_compose(["prompts=[]", "prompt=x"])).prompt_list() == ["x"]
    assert to_job(_compose(["prompts=[]", "+experiment=cf_sweep"])).task == "cf_sweep"  # a lab task needs none


def test_prompt_file_is_the_one_prompt(tmp_path, monkeypatch):
    path = tmp_path / "p.txt"
    path.write_text('def quicksort(xs):\n    """sort (a list)"""\n')
    job = to_job(_compose([f"prompt_file={path}", "prompts=[]"]))
    assert job.prompt_list() == ['def quicksort(xs):\n    """sort (a list)"""']  # one trailing newline dropped
    monkeypatch.setattr("sys.stdin", io.StringIO("def f(x):"))
    assert to_job(_compose(["prompt_file=-"])).prompt_list() == ["def f(x):"]
    with pytest.raises(ValueError, match="prompt_file='/no/such/file': no such file"):
        to_job(_compose(["prompt_file=/no/such/file"]))
    with pytest.raises(ValueError, match="prompt and prompt_file are both set"):
        to_job(_compose([f"prompt_file={path}", "prompt=x"]))
