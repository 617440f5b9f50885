"""Trial (measurement notes): a saturated engine whose requests all end by length together (short outputs, EOS
ignored), with async scheduling on and off. Counts engine steps, the steps that launched a plan and those that
only collected the step in flight, sequences per launched step, wall time and output tok/s; checks that the
async engine's tokens equal the synchronous engine's (greedy and seeded requests).

Before the fix (sequences that the step in flight ends by length held their max_num_seqs seats until it was
collected), the step scheduled while a batch's last step ran could admit nobody: it launched nothing, and on a
GPU the device idled while the host collected. Measured on the shared 2-core CPU (tiny dims, 320 requests of 8
tokens, max_num_seqs=16; at main cc9be17 and with the fix), engine steps / steps that launched nothing:

    max_tokens   sync      async before   async after
    1            20 / 0    40 / 20        21 / 1
    4            80 / 0    100 / 20       81 / 1
    16           320 / 0   340 / 20       321 / 1

Every launched step ran 16 sequences in all six, and the wall times were equal (1.27-1.29 s at max_tokens 16):
on the CPU the "device" is the host, so a step that only collects costs no forward and nothing overlaps anyway.
The wall-time effect needs the GPU run below (not run yet).

    python benchmarks/trials/async_saturation.py                  # CPU, tiny dims: ~30 s
    python benchmarks/trials/async_saturation.py --device cuda    # GPU, Qwen3-30B-A3B layer shape, 4 layers
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

import e2e_generate as e2e  # noqa: E402


def run(llm, prompts, max_tokens, device):
    """One pass over prompts: (outputs by request id, engine steps, launched plan sizes, wall s)."""
    from moe_infer import SamplingParams
    eng, sched = llm.engine, llm.engine.scheduler
    plans, real = [], sched.schedule
    sched.schedule = lambda: plans.append(real()) or plans[-1]  # the plan of every step
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=max_tokens, ignore_eos=True)
        eng.add_request({"prompt_token_ids": p}, sp, str(i))
    e2e.sync(device)
    start, steps, finals = time.perf_counter(), 0, {}
    while eng.has_unfinished_requests():
        finals.update((o.request_id, o.outputs[0].token_ids) for o in eng.step(final_only=True) if o.finished)
        steps += 1
    e2e.sync(device)
    del sched.schedule
    return finals, steps, [len(p.seqs) for p in plans if not p.is_empty], time.perf_counter() - start


def main():
    from moe_infer import LLM
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", default="1,4,16", help="comma-separated output lengths")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared CPU: spinning worker threads make timings erratic
    gpu = device.type == "cuda"
    dims, dtype = (e2e.REAL, torch.bfloat16) if gpu else (e2e.TINY, torch.float32)
    max_seqs, prompt_len, batches = (64, 128, 8) if gpu else (16, 8, 20)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, dims["vocab_size"], (max_seqs * batches, prompt_len), generator=g).tolist()
    print(f"{e2e.device_label(device)}: {len(prompts)} requests of {prompt_len} tokens, max_num_seqs={max_seqs}")
    print(f"{'max_tokens':>10} {'async':>5} {'steps':>6} {'launched':>8} {'collect-only':>12} {'seqs/launch':>11} "
          f"{'wall s':>7} {'out tok/s':>9} {'== sync':>7}")
    with tempfile.TemporaryDirectory() as ckpt:
        e2e.build_checkpoint(dims, dtype, device, ckpt)  # the HF model returned is not needed
        if gpu:
            torch.cuda.empty_cache()  # the KV cache is sized from the free memory
        kw = dict(model=ckpt, dtype=str(dtype).split(".")[1], device=args.device, max_num_seqs=max_seqs,
                  max_num_batched_tokens=max_seqs * prompt_len, enable_prefix_caching=False)
        engines = {a: LLM(**kw, async_scheduling=a) for a in (False, True)}
        for max_tokens in (int(m) for m in args.max_tokens.split(",")):
            for llm in engines.values():
                run(llm, prompts[:max_seqs], max_tokens, device)  # warm-up
            runs = {a: [] for a in engines}
            for _ in range(3):  # best of 3, the two engines alternating (a shared CPU drifts)
                for a, llm in engines.items():
                    runs[a].append(run(llm, prompts, max_tokens, device))
            for a, (outs, steps, sizes, _) in ((a, r[0]) for a, r in runs.items()):
                wall = min(r[3] for r in runs[a])
                print(f"{max_tokens:>10} {'on' if a else 'off':>5} {steps:>6} {len(sizes):>8} "
                      f"{steps - len(sizes):>12} {sum(sizes) / len(sizes):>11.1f} {wall:>7.3f} "
                      f"{len(prompts) * max_tokens / wall:>9.0f} {str(outs == runs[False][0][0]):>7}")


if __name__ == "__main__":
    main()
