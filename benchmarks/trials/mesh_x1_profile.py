"""Trial (not kept): where the mesh's degree-1 path loses against the plain engine on one GPU.

    python benchmarks/trials/mesh_x1_profile.py
b1: cProfile of the driver's host work over a 64-token generate, plain vs mesh x1; b256: CUDA kernel time per
kernel name over a 16-token generate (torch.profiler), plain vs mesh x1.
"""
import cProfile, io, os, pstats, sys, tempfile, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch
import mesh_scaling as ms
from moe_infer import LLM, SamplingParams

tmp = tempfile.mkdtemp()
ckpt = ms.write_config(ms.SMALL, tmp)
kw = dict(model=ckpt, load_format="dummy", dtype="bfloat16", device="cuda", max_num_seqs=256, max_num_batched_tokens=16384,
          max_model_len=1100, num_kv_blocks=6000, enable_prefix_caching=False, cuda_graph_max_batch=256)
engines = {"plain": LLM(**kw), "mesh": LLM(**kw, force_mesh=True)}
V = ms.SMALL["vocab_size"]

def gen(llm, b, n):
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    torch.cuda.synchronize(); t = time.perf_counter()
    llm.generate([{"prompt_token_ids": x} for x in ms.gen_ids(b, b, 128, V)], p, use_tqdm=False)
    torch.cuda.synchronize(); return time.perf_counter() - t

for name, llm in engines.items():
    for b in (1, 256):
        gen(llm, b, 4)
for name, llm in engines.items():
    print(name, "b1 64 tokens", gen(llm, 1, 64), "b256 16 tokens", gen(llm, 256, 16))
for name, llm in engines.items():
    pr = cProfile.Profile(); pr.enable(); gen(llm, 1, 64); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(f"==== {name} b1 tottime\n", s.getvalue()[-5000:])
for name, llm in engines.items():
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen(llm, 256, 16)
    print(f"==== {name} b256 kernels\n", prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
