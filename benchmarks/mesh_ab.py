"""One GPU, tp = pp = ep = 1: the engine before the mesh change and after it, in the same run.

    python benchmarks/mesh_ab.py [--base REV | --base-tree DIR] [--out X.json]    # ~6 min on an H100

The base tree is `git worktree add` of REV (default: the parent of the oldest commit whose subject
starts with "mesh:", i.e. the code before the mesh), or a tree extracted beforehand (--base-tree,
e.g. `git archive REV | tar -x -C DIR`) where the machine has no git history. Both trees run the same
driver (below) through the public `LLM` API, each in a fresh process with its own tree first on
PYTHONPATH, in the order base, head, head, base (drift cancels): e2e_generate.py's Qwen3-MoE-shaped
model (real dimensions, 4 layers, random weights, built once), greedy, prompt 128, 64 new tokens,
batches 1, 16, 64, each warmed up first, with CUDA-graph decode (the default) and eager. Reports
output tokens/s per tree (mean of its two runs), head / base, and whether both trees produced the
same tokens. The roofline of a decode step is not the question here; the baseline is the base tree.
Writes mesh_ab_<device>.json to --out, else $OUT, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
HEAD_TREE = os.path.dirname(HERE)

ARM = r"""
import json, sys, time
import torch
from moe_infer import LLM, SamplingParams

ckpt, batches, prompt_len, num_new, out = sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
device, vocab = sys.argv[6], int(sys.argv[7])
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
gen = torch.Generator().manual_seed(0)
rows = {}
for eager in ((False, True) if device == "cuda" else (True,)):
    t0 = time.perf_counter()
    llm = LLM(model=ckpt, dtype="bfloat16" if device == "cuda" else "float32", device=device,
              max_num_seqs=max(batches), max_num_batched_tokens=4096, max_model_len=prompt_len + num_new + 16,
              enforce_eager=eager)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    for b in batches:
        warm = torch.randint(2, vocab, (b, prompt_len), generator=gen).tolist()
        prompts = torch.randint(2, vocab, (b, prompt_len), generator=gen).tolist()
        llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        sync()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        sync()
        dt = time.perf_counter() - t
        rows[f"{'eager' if eager else 'graphs'}_b{b}"] = dict(tok_s=b * num_new / dt, s=dt, load_s=load_s,
                                                              tokens=[o.outputs[0].token_ids for o in outs])
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
json.dump(rows, open(out, "w"))
"""


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=HEAD_TREE, check=True, capture_output=True, text=True).stdout.strip()


def default_base() -> str:
    mesh = git("log", "--format=%H", "--grep=^mesh:", "--reverse").split()
    if not mesh:
        raise SystemExit("no commit subject starts with 'mesh:': give --base REV or --base-tree DIR")
    return git("rev-parse", f"{mesh[0]}^")


def run_arm(tree: str, ckpt: str, args, out: str, device: str, vocab: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-c", ARM, ckpt, args.batches, str(args.prompt_len), str(args.new_tokens), out, device,
           str(vocab)]
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=None, help="git revision of the code before the change")
    ap.add_argument("--base-tree", default=None, help="an extracted tree of that revision (no git needed)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU, eager only: a smoke run of the mechanics")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    sys.path.insert(0, HEAD_TREE)
    from benchmarks.e2e_generate import REAL, TINY, build_checkpoint, device_label, write_result

    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (the question is the single-GPU speed); --tiny runs on CPU")
    device = torch.device("cpu" if args.tiny else "cuda")
    dims = TINY if args.tiny else REAL
    work = tempfile.mkdtemp(prefix="mesh_ab_")
    try:
        base_rev = None
        base_tree = args.base_tree
        if base_tree is None:
            base_rev = args.base or default_base()
            base_tree = os.path.join(work, "base")
            git("worktree", "add", "--detach", base_tree, base_rev)
        ckpt = os.path.join(work, "ckpt")
        hf = build_checkpoint(dims, torch.float32 if args.tiny else torch.bfloat16, device, ckpt)
        del hf  # transformers' model is not the question here
        if device.type == "cuda":
            torch.cuda.empty_cache()
        runs = {"base": [], "head": []}
        for i, which in enumerate(("base", "head", "head", "base")):
            tree = base_tree if which == "base" else HEAD_TREE
            print(f"run {i + 1}/4: {which} ({tree})", flush=True)
            runs[which].append(run_arm(tree, ckpt, args, os.path.join(work, f"arm{i}.json"), device.type,
                                       dims["vocab_size"]))
    finally:
        if args.base_tree is None and os.path.isdir(os.path.join(work, "base")):
            git("worktree", "remove", "--force", os.path.join(work, "base"))
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for key in runs["head"][0]:
        base = sum(r[key]["tok_s"] for r in runs["base"]) / 2
        head = sum(r[key]["tok_s"] for r in runs["head"]) / 2
        rows.append(dict(case=key, base_tok_s=base, head_tok_s=head, head_over_base=head / base,
                         spread_base=[r[key]["tok_s"] for r in runs["base"]],
                         spread_head=[r[key]["tok_s"] for r in runs["head"]],
                         same_tokens=runs["base"][0][key]["tokens"] == runs["head"][0][key]["tokens"]))
    result = dict(benchmark="mesh_ab", device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__,
                  base=base_rev or args.base_tree, head=git("rev-parse", "HEAD") if base_rev else None,
                  model=dict(family="qwen3_moe", **{k: v for k, v in dims.items() if k != "rope_parameters"}),
                  prompt_len=args.prompt_len, new_tokens=args.new_tokens, rows=rows)
    print(f"tp = pp = ep = 1 on {result['device']}: output tokens/s, base {result['base']} vs head")
    print(f"{'case':>12} {'base':>9} {'head':>9} {'head/base':>9} {'same tokens':>11}")
    for r in rows:
        print(f"{r['case']:>12} {r['base_tok_s']:>9.1f} {r['head_tok_s']:>9.1f} {r['head_over_base']:>9.3f} "
              f"{str(r['same_tokens']):>11}")
    write_result(result, f"mesh_ab_{device_label(device)}{'_tiny' if args.tiny else ''}.json", args.out)


if __name__ == "__main__":
    main()
