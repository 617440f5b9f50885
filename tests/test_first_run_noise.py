"""A first run on a CPU install says what matters once: skipped backends in one line, no H2D figure without a
GPU, the start-up notes from rank 0 only, no transformers sequence-length warning for a long prompt."""
from __future__ import annotations

import importlib
import logging

import pytest
import torch

from moe_infer import LLM, SamplingParams, plugins
from moe_infer.assets import default_model_path
from moe_infer.engine.encode import encode
from moe_infer.offload.cost import CostModel
from moe_infer.parallel.rank_logs import PACKAGE_LOGGER, quiet_follower_logs

pytestmark = pytest.mark.timeout(180)
LENGTH_WARNING = "Token indices sequence length is longer than the specified maximum sequence length"


@pytest.mark.parametrize("has_cuda, level", [(False, logging.DEBUG), (True, logging.INFO)])
def test_missing_backends_are_one_line_once(monkeypatch, caplog, has_cuda, level):
    monkeypatch.setattr(plugins, "_loaded", [])
    monkeypatch.setattr(plugins, "_missing", {})
    monkeypatch.setattr(plugins, "_done", [])
    real = importlib.import_module

    def no_triton(name, *a, **kw):  # as on a CPU install: every plugin module imports triton
        if name in plugins.PLUGIN_MODULES:
            raise ModuleNotFoundError("No module named 'triton'", name="triton")
        return real(name, *a, **kw)

    monkeypatch.setattr(plugins.importlib, "import_module", no_triton)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_cuda)
    with caplog.at_level(logging.DEBUG, logger="moe_infer.plugins"):
        assert plugins.load_plugins() == [] and plugins.load_plugins() == []
    (record,) = [r for r in caplog.records if r.name == "moe_infer.plugins"]
    assert record.levelno == level
    msg = record.getMessage()
    assert msg.startswith(f"{len(plugins.PLUGIN_MODULES)} backend modules not loaded (No module named 'triton')")
    assert all(name.rsplit(".", 1)[-1] in msg for name in plugins.PLUGIN_MODULES)


def test_the_cost_model_line_has_no_h2d_figure_without_a_gpu():
    cost = CostModel(h2d_bytes_per_s=1e8, cpu_seconds_at=((1, 1e-4), (4, 2e-4)))
    assert "H2D 0.1 GB/s" in cost.describe(2**20)  # the GPU default
    cpu = cost.describe(2**20, "cpu")
    assert "H2D" not in cpu.replace("no H2D link", "") and "GB/s" not in cpu and "no GPU" in cpu


@pytest.fixture
def package_level():
    package = logging.getLogger(PACKAGE_LOGGER)
    before = package.level
    yield package
    package.setLevel(before)


def test_ranks_other_than_the_driver_log_warnings_only(package_level, caplog):
    child = logging.getLogger("moe_infer.engine.some_module")
    with caplog.at_level(logging.INFO):  # the root's level: what a launcher's logging config lets through
        quiet_follower_logs(0)
        child.info("note on rank 0")
        quiet_follower_logs(1)
        child.info("the same note on rank 1")
        child.warning("a warning on rank 1")
        logging.getLogger("other_library").info("not ours")
    assert [r.getMessage() for r in caplog.records] == ["note on rank 0", "a warning on rank 1", "not ours"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def take(self) -> str:
        text, self.messages = "\n".join(self.messages), []
        return text


@pytest.fixture
def transformers_logs():
    """What transformers logs (its library logger does not propagate to the root, so caplog misses it; its own
    stderr handler may hold an earlier test's stream, so capfd may too)."""
    handler = _Records()
    logging.getLogger("transformers").addHandler(handler)
    yield handler
    logging.getLogger("transformers").removeHandler(handler)


def test_a_long_prompt_and_an_offload_run_say_nothing_misleading(transformers_logs, caplog):
    from transformers import AutoTokenizer

    text = "x " * 1100  # past the tiny tokenizer's model_max_length (1024)
    assert len(encode(AutoTokenizer.from_pretrained(default_model_path()), text)) > 1024
    assert LENGTH_WARNING not in transformers_logs.take()
    with caplog.at_level(logging.INFO, logger="moe_infer.offload"):
        llm = LLM(device="cpu", dtype="float32", num_kv_blocks=64, offload="cpu")
    (line,) = [r.getMessage() for r in caplog.records if "offload cost model" in r.getMessage()]
    assert "no GPU" in line and "GB/s" not in line, line
    transformers_logs.take()
    out = llm.generate([text], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error" and "too long" in out.error  # the engine's own length check says it
    assert LENGTH_WARNING not in transformers_logs.take()
    llm.get_tokenizer()(text)  # the control: transformers' own call warns, and this test would see it
    assert LENGTH_WARNING in transformers_logs.take()


def test_gpu_only_notes_are_debug_on_the_cpu(caplog):
    with caplog.at_level(logging.DEBUG, logger="moe_infer"):
        LLM(device="cpu", dtype="float32", num_kv_blocks=16)
    notes = {r.getMessage().split(":")[0]: r.levelno for r in caplog.records
             if "eagerly" in r.getMessage() or "warm-up" in r.getMessage()}
    assert notes == {"decode steps run eagerly": logging.DEBUG, "prefill and mixed steps run eagerly": logging.DEBUG,
                     "no start-up warm-up of the Triton kernels": logging.DEBUG}
