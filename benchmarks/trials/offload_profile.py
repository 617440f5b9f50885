"""Trial: where an eager decode step's time goes, resident vs offload (cProfile + torch.profiler)."""
import cProfile, io, os, pstats, random, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from moe_infer import LLM, SamplingParams

def cfg(name, layers):
    if name == "mixtral":
        c = MixtralConfig(num_hidden_layers=layers)
        c.architectures = ["MixtralForCausalLM"]
    else:
        c = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_hidden_layers=layers,
                           num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                           num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        c.architectures = ["Qwen3MoeForCausalLM"]
    d = tempfile.mkdtemp(); c.save_pretrained(d); return d, c

def sync(): torch.cuda.synchronize() if torch.cuda.is_available() else None

def case(name, layers, store, eager, streams, slots=None, budget=None, prof=True):
    d, c = cfg(name, layers)
    kw = {}
    if store != "resident":
        kw = dict(offload=store, **({"slots_per_layer": slots} if slots else {"gpu_expert_budget_gb": budget}))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(model=d, load_format="dummy", dtype="bfloat16", device=dev, num_kv_blocks=96, block_size=16,
              max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512, enable_prefix_caching=False,
              enforce_eager=eager, **kw)
    eng = llm.engine
    p = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    rng = random.Random(0)
    for _ in range(streams):
        eng.add_request({"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(16)]}, p)
    for _ in range(8): eng.step()
    sync(); t0 = time.perf_counter()
    for _ in range(20): eng.step()
    sync(); ms = (time.perf_counter() - t0) / 20 * 1e3
    tag = f"{name} L={layers} {store} eager={eager} streams={streams}"
    print(f"=== {tag}: {ms:.2f} ms/step ({ms/layers:.2f} ms/layer)", flush=True)
    if store != "resident":
        t = llm.get_offload_stats()["total"]
        print({k: round(t[k], 3) for k in ("hit_rate", "cpu_share", "stream_share", "gb_h2d", "prefetch_token_recall")})
    if prof:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(5): eng.step()
        sync(); pr.disable()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(s.getvalue()[-6000:])
        from torch.profiler import profile, ProfilerActivity
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
        with profile(activities=acts) as tp:
            for _ in range(3): eng.step()
            sync()
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=16))
    llm.shutdown(); del llm, eng
    import gc; gc.collect(); torch.cuda.empty_cache() if dev == "cuda" else None

if __name__ == "__main__":
    which = sys.argv[1:] or ["all"]
    small = not torch.cuda.is_available()
    if small:
        case("qwen3", 2, "cpu", True, 1, slots=38)
        sys.exit()
    case("qwen3", 8, "resident", True, 1)
    case("qwen3", 8, "cpu", True, 1, slots=38)
    case("mixtral", 4, "cpu", True, 1, budget=4 * 2 * 0.352 / 1.074 + 0.8)
