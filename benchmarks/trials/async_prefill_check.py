"""Trial (measurement notes): why a 16 x 1024 prefill measured slower with async scheduling on (engine_roofline
at 12f02dd: 224k against 345k prompt tok/s). Times the same prefill on both engines alternately, each
engine.step() of it, and profiles one call per engine (top host ops).

    python benchmarks/trials/async_prefill_check.py
"""
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

import e2e_generate as e2e  # noqa: E402


def main():
    from moe_infer import LLM, SamplingParams
    from torch.profiler import ProfilerActivity, profile
    dims = dict(e2e.REAL, num_hidden_layers=8)
    g = torch.Generator().manual_seed(0)
    ids = lambda b, n: torch.randint(2, dims["vocab_size"], (b, n), generator=g).tolist()  # noqa: E731
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with tempfile.TemporaryDirectory() as ckpt:
        hf = e2e.build_checkpoint(dims, torch.bfloat16, torch.device("cuda"), ckpt)
        del hf
        torch.cuda.empty_cache()
        kw = dict(model=ckpt, dtype="bfloat16", device="cuda", max_num_seqs=64, max_num_batched_tokens=16384,
                  max_model_len=1041, num_kv_blocks=1152, enable_prefix_caching=False)
        engines = {a: LLM(**kw, async_scheduling=a) for a in (True, False)}
        for a, llm in engines.items():
            for _ in range(2):
                llm.generate([{"prompt_token_ids": p} for p in ids(16, 1024)], params, use_tqdm=False)
        for rep in range(3):
            for a, llm in engines.items():
                prompts = ids(16, 1024)
                eng = llm.engine
                for p in prompts:
                    eng.add_request({"prompt_token_ids": p}, params)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                steps = []
                while eng.has_unfinished_requests():
                    s = time.perf_counter()
                    eng.step()
                    steps.append(1e3 * (time.perf_counter() - s))
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                print(f"rep {rep} async={a}: {16 * 1024 / wall / 1e3:.0f}k tok/s, {1e3 * wall:.1f} ms; steps (ms) "
                      + ", ".join(f"{x:.1f}" for x in steps), flush=True)
        for a, llm in engines.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                llm.generate([{"prompt_token_ids": p} for p in ids(16, 1024)], params, use_tqdm=False)
                torch.cuda.synchronize()
            print(f"=== async={a}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=50))


if __name__ == "__main__":
    main()
