"""Every fenced command of README.md and docs/*.md runs on the CPU, or is on CANNOT_RUN_ON_CPU with the reason.

Each shell command runs as written (bash, from a scratch folder holding a copy of benchmarks/ and links to the
package, scripts/ and tests/, with `python` the interpreter running the tests and $OUT the scratch folder, so
nothing is written into the checkout) and must exit 0. The python snippets of one doc run in order in one
interpreter. A command that matches no entry of the list and cannot run fails here: a new doc command needs
either to run on a CPU or a reviewed entry below. An entry that matches no command fails too (the list stays
current). The commands are whole-program runs on the tiny model: a few seconds to a minute each.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from doc_blocks import ROOT, all_commands, python_blocks, strip_comment, user_docs  # noqa: E402

GPU = "needs a CUDA GPU"
CKPT = "needs a downloaded checkpoint"
# (pattern searched in the command or snippet, why it cannot run in CPU CI). Reviewed: keep each reason true.
CANNOT_RUN_ON_CPU = [
    (r"^pip install", "installs packages (.ci/run runs the README's set-up lines in fresh environments)"),
    (r"/ckpt/|/path/to/", CKPT),
    (r"-m gpu\b", "the GPU test suite"),
    (r"-m \"not gpu\"", "the CPU test suite itself (CI runs it)"),
    (r"--nnodes 2", "several machines"),
    (r"\bserve\b", "starts a server that runs until stopped (tests/test_server*.py start it and send requests)"),
    (r"from openai import", "a client of a running server"),
    (r"benchmarks/(attention|fused_moe|routing|deepseek_v3|mesh_scaling|offload|serving|quant_moe|quant_e2e)\.py$",
     GPU),
    (r"benchmarks/(e2e_generate|engine_roofline|startup|speculative)\.py$", GPU),
    (r"run_mesh_gpu\.sh", "needs 2 or more GPUs"),
    (r"scripts/tune_fused_moe\.py", GPU),
    (r"group=option", "a template of the syntax, not a command"),
    (r"benchmarks/startup\.py --tiny$", "runs in tests/test_startup_bench.py, which also checks what it writes"),
    (r"benchmarks/quant_(moe|e2e)\.py --tiny$", "runs in tests/test_quant_bench.py, which also checks what it writes"),
    (r"<time>", "a template: names the output folder of an earlier run"),
    (r"stats:load\.json", "needs a load.json of your own (LLM.get_expert_load() written to a file)"),
    (r"--nproc-per-node [48]\b", "needs 4 or 8 ranks: too heavy for CPU CI (2-rank CPU commands run here)"),
    (r"--multirun \+experiment=cf_sweep$", "36 runs of the tiny model: many minutes of CPU (the 2-run sweep below runs)"),
    (r"lab\.out_dir=benchmarks/results/load_balance", "rewrites the committed report page (a maintainer's step)"),
]
SCRATCH_LINKS = ("moe_infer", "scripts", "tests")


def code(text: str) -> str:
    """The text without comments: a comment may mention a checkpoint path the code does not use."""
    return "\n".join(strip_comment(line) for line in text.splitlines())


def reason(text: str):
    text = code(text)
    for pattern, why in CANNOT_RUN_ON_CPU:
        if re.search(pattern, text, re.M):
            return why
    return None


COMMANDS = all_commands()
RUNNABLE = [c for c in COMMANDS if reason(c.text) is None]


def test_every_entry_of_the_list_matches_a_command():
    texts = [c.text for c in COMMANDS] + [code(b.text) for doc in user_docs() for b in python_blocks(doc)]
    unused = [p for p, _ in CANNOT_RUN_ON_CPU if not any(re.search(p, t, re.M) for t in texts)]
    assert not unused, f"entries of CANNOT_RUN_ON_CPU that match no doc command (remove them): {unused}"


def test_the_docs_have_commands_that_run():
    assert len(COMMANDS) > 20 and len(RUNNABLE) > 10, (len(COMMANDS), len(RUNNABLE))


@pytest.fixture
def scratch(tmp_path):
    """A folder to run in: a copy of benchmarks/ (its scripts write beside themselves), links to the rest, and a
    `python` on PATH that is this interpreter."""
    shutil.copytree(os.path.join(ROOT, "benchmarks"), tmp_path / "benchmarks")
    for name in SCRATCH_LINKS:
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    bin_dir = tmp_path / "_bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python"  # a script, not a link: a link out of a virtual environment loses it
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, PATH=os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable),
                                                 os.environ.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               OUT=str(tmp_path / "out"), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    (tmp_path / "out").mkdir()
    return tmp_path, env


def run(cmd: str, cwd, env, timeout: float = 480) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("command", RUNNABLE, ids=[c.where for c in RUNNABLE])
def test_doc_command_runs_on_cpu(command, scratch):
    cwd, env = scratch
    if command.text.startswith("torchrun"):
        pytest.importorskip("torch.distributed.run")
    proc = run(command.text, cwd, env)
    assert proc.returncode == 0, (f"{command.where}: `{command.text}` exited {proc.returncode}\n"
                                  f"--- stdout (end)\n{proc.stdout[-3000:]}\n--- stderr (end)\n{proc.stderr[-5000:]}")


DOCS_WITH_PYTHON = [d for d in user_docs() if python_blocks(d)]
RUNNER = """
import sys
ns = {"__name__": "__main__"}
for path, where in zip(sys.argv[1::2], sys.argv[2::2]):
    print(f"=== {where}", flush=True)
    exec(compile(open(path).read(), where, "exec"), ns)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("doc", DOCS_WITH_PYTHON)
def test_doc_python_snippets_run_on_cpu(doc, scratch):
    cwd, env = scratch
    args = []
    for i, block in enumerate(python_blocks(doc)):
        if reason(block.text) is None:
            path = cwd / f"snippet_{i}.py"
            path.write_text(block.text)
            args += [str(path), f"{doc}:{block.line}"]
    if not args:
        pytest.skip(f"every python snippet of {doc} is on CANNOT_RUN_ON_CPU")
    proc = subprocess.run([sys.executable, "-c", RUNNER, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=480, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{doc}: a snippet failed\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
