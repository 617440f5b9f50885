"""Trial (measurement notes): serving.py's offline load (`LLM.generate` over N prompts at saturation) on
several source trees in turn, on one checkpoint, alternating, so that an engine change is timed against the
tree before it on the same machine (the machines lent differ by up to ~15 %).

    git archive <commit> | tar -x -C _old     # a tree to compare with (untracked: it travels to the device)
    python benchmarks/trials/offline_ab.py --trees _old,. --repeats 2
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

CHILD = """
import json, sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import serving
class Q:
    def put(self, x): print("RESULT " + json.dumps(x), flush=True)
a = json.load(open(sys.argv[1]))
serving._offline(a["ckpt"], a["kw"], a["warm"], a["prompts"], a["output_len"], Q())
"""


def main():
    import serving
    from e2e_generate import REAL

    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", default=".")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    args = ap.parse_args()
    args.device = "cuda"
    trees = args.trees.split(",")
    with tempfile.TemporaryDirectory(prefix="offline_ab_") as ckpt:
        proc, _ = serving.run_child(serving._build, dict(REAL, vocab_size=6144), "cuda", ckpt)
        proc.join()
        warm = serving.warm_load(ckpt, args)
        prompts = [p.text for p in serving.prompts_from(ckpt, args.num_requests, args.input_len, seed=7)]
        payload = os.path.join(ckpt, "offline_ab_load.json")
        with open(payload, "w") as f:
            json.dump(dict(ckpt=ckpt, kw=serving.engine_kwargs(args), warm=warm, prompts=prompts,
                           output_len=args.output_len), f)
        results = {t: [] for t in trees}
        for r in range(args.repeats):
            for tree in trees:
                out = subprocess.run([sys.executable, "-c", CHILD, payload], cwd=tree, capture_output=True, text=True)
                line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                if not line:
                    print(out.stderr[-3000:])
                    raise SystemExit(f"{tree}: no result")
                res = json.loads(line[0][7:])
                results[tree].append(res["output_tok_s"])
                print(f"repeat {r} {tree}: {res['output_tok_s']:.0f} output tok/s ({res['elapsed_s']:.2f} s)", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
