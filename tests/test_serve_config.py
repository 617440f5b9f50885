"""The `serve` Hydra group and entry: it composes with every other group, checks its fields by name, and
`--flag value` shorthands become `serve.flag=value` overrides."""
import pytest

pytest.importorskip("hydra", reason="the Hydra launcher's configs need hydra-core")
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.errors import ConfigCompositionException  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from moe_infer.launch import CONF_DIR  # noqa: E402
from moe_infer.server.config import ServeConfig  # noqa: E402
from moe_infer.server.launch import flags_to_overrides  # noqa: E402


def job(overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return OmegaConf.to_object(compose(config_name="config", overrides=overrides))


@pytest.mark.timeout(60)
def test_serve_composes_with_the_other_groups():
    j = job(["serve=public", "parallel=ep", "parallel.ep=4", "routing=drop", "model=hf", "model.path=/ckpt",
             "+experiment=throughput", "serve.port=9001", "serve.api_key=k"])
    assert isinstance(j.serve, ServeConfig) and j.serve.host == "0.0.0.0" and j.serve.port == 9001
    assert j.serve.api_key == "k" and j.engine_config().parallel.ep == 4 and j.serve.max_n == 16
    with pytest.raises(ConfigCompositionException, match="max_queue"):
        job(["serve.max_queue=3"])  # misspelt: the real field is max_queued_requests
    with pytest.raises(ConfigCompositionException, match="port"):
        job(["serve.port=many"])


@pytest.mark.parametrize("kw,field", [(dict(port=70000), "serve.port"), (dict(max_n=0), "serve.max_n"),
                                      (dict(log_level="loud"), "serve.log_level"), (dict(api_key=""), "serve.api_key"),
                                      (dict(max_prompt_tokens=0), "serve.max_prompt_tokens"),
                                      (dict(api_server_count=0), "serve.api_server_count"),
                                      (dict(api_server_count=2, engine_loop="thread"), "serve.engine_loop=process")])
def test_bad_serve_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ServeConfig(**kw)


def test_flags_become_serve_overrides():
    argv = ["model=hf", "--port", "8001", "--api-key=abc", "--max-queued-requests", "5", "parallel.ep=2", "--help"]
    assert flags_to_overrides(argv) == ["model=hf", "serve.port=8001", "serve.api_key=abc",
                                        "serve.max_queued_requests=5", "parallel.ep=2", "--help"]
    with pytest.raises(SystemExit, match="--port needs a value"):
        flags_to_overrides(["--port"])
