"""The main job as a user starts it: no triton needed on CPU, failures exit non-zero, the package ships conf/."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_NO_TRITON = textwrap.dedent("""
    import sys

    class NoTriton:  # as on a machine where `pip install -e .` did not install triton
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NoTriton())
""")


def _python(code: str, *args: str, timeout: float = 120, stdin: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a user's shell, not the test's
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, input=stdin)


@pytest.mark.timeout(180)
def test_main_job_runs_on_cpu_without_triton():
    code = _NO_TRITON + textwrap.dedent("""
        from moe_infer.launch import main
        sys.argv = ["moe-infer", "sampling.max_tokens=4", "show_progress=false"]
        main()
        assert "triton" not in sys.modules, "the CPU engine imported triton"
    """)
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "output tokens/s" in proc.stdout and "per-layer expert load" in proc.stdout


@pytest.mark.timeout(180)
def test_main_job_exits_non_zero_when_a_request_fails():
    code = "import sys\nfrom moe_infer.launch import main\nsys.argv = ['moe-infer'] + sys.argv[1:]\nmain()"
    proc = _python(code, "prompt=a b c d e f g h i j k l", "model.max_model_len=8", "show_progress=false")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "too long: max_model_len is 8" in proc.stdout and "1 of 1 requests failed" in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("override, error", [("+foo=1", "unknown config keys ['foo']"),
                                             ("prompts=[]", "prompts is empty")])
def test_main_job_refuses_an_added_key_and_no_prompts(override, error):
    code = "import sys\nfrom moe_infer.launch import main\nsys.argv = ['moe-infer'] + sys.argv[1:]\nmain()"
    proc = _python(code, override, "show_progress=false")
    assert proc.returncode == 1 and error in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tokens/s" not in proc.stdout  # refused before any engine was built


@pytest.mark.timeout(180)
def test_main_job_reads_a_prompt_from_stdin():
    """prompt_file=-: a prompt with Hydra syntax in it, no quoting (docs/running.md's quicksort example)."""
    code = "import sys\nfrom moe_infer.launch import main\nsys.argv = ['moe-infer'] + sys.argv[1:]\nmain()"
    proc = _python(code, "prompt_file=-", "sampling.max_tokens=4", "show_progress=false", "show_expert_load=false",
                   stdin="def quicksort(xs):\n")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "prompt: 'def quicksort(xs):'" in proc.stdout and "1 requests, 4 output tokens" in proc.stdout


@pytest.mark.timeout(60)
def test_the_launcher_composes_its_job_before_torch_loads():
    """The offload host threads' wait policy must be in the environment before torch loads (libgomp reads it
    then): `import moe_infer` and the launcher's configuration import no torch."""
    proc = _python("import sys\nimport moe_infer, moe_infer.launch\nassert 'torch' not in sys.modules, "
                   "[m for m in sys.modules if m.startswith('moe_infer')]\nfrom moe_infer import LLM\n"
                   "assert 'torch' in sys.modules and LLM.__name__ == 'LLM'")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cuda_present,policy", [(True, "ACTIVE OMP_NUM_THREADS=1"), (False, "unset")])
def test_main_job_sets_the_host_threads_policy_before_torch(cuda_present, policy):
    """offload=cpu where the launcher expects a GPU (model.device=auto, the driver's node faked present here):
    the main job starts with OMP_WAIT_POLICY=ACTIVE and a pool that leaves the main thread a core (2 cores
    faked: 1 thread), and its offload summary line says so; without a GPU, neither. The engine itself runs on
    the CPU either way (torch finds no CUDA)."""
    code = textwrap.dedent(f"""
        import os, sys
        from moe_infer import host_threads
        from moe_infer.launch import main
        host_threads.cuda_present = lambda *a: {cuda_present}
        host_threads.host_cores = lambda: 2
        os.environ.pop("OMP_WAIT_POLICY", None)
        os.environ.pop("OMP_NUM_THREADS", None)
        sys.argv = ["moe-infer"] + sys.argv[1:]
        main()
    """)
    proc = _python(code, "offload=cpu", "sampling.max_tokens=4", "show_progress=false", "show_expert_load=false")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("offload: hit rate"))
    assert line.endswith(f"host threads OMP_WAIT_POLICY={policy}"), line


@pytest.mark.timeout(120)
def test_triton_backends_are_refused_on_cpu_at_start(monkeypatch):
    from moe_infer.config import EngineConfig, ExpertsConfig, RoutingConfig
    from moe_infer.engine.backends import resolve_moe_backends

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="experts.backend=triton .* need a CUDA device; this engine runs on cpu"):
        resolve_moe_backends(EngineConfig(experts=ExpertsConfig(backend="triton")), "cpu")
    with pytest.raises(ValueError, match="routing.backend=triton"):
        resolve_moe_backends(EngineConfig(routing=RoutingConfig(backend="triton")), "cpu")
    assert resolve_moe_backends(EngineConfig(), "cpu").experts == "torch"  # auto still works


@pytest.mark.timeout(300)
def test_wheel_ships_every_config_file(tmp_path):
    src = tmp_path / "src"  # a clean copy: an editable install's egg-info would list the files for setuptools
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "*.egg-info", "build", "__pycache__", "outputs",
                                                              "multirun", ".whl", ".gl", ".device_out"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    names = set(zipfile.ZipFile(tmp_path / wheel).namelist())
    conf = os.path.join(ROOT, "moe_infer", "conf")
    wanted = {os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
              for d, _, files in os.walk(conf) for f in files if f.endswith(".yaml")}
    assert wanted and wanted <= names, sorted(wanted - names)
    assert "moe_infer/assets/tiny_moe/model.safetensors" in names
