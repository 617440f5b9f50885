"""Trial: host time of the gather+SDPA attention path per eager call, new vs repeated context lengths,
with torch's backend choice and with cuDNN attention excluded."""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from moe_infer.layers.paged_attention import paged_attention_sdpa
from moe_infer.kernels.paged_attention import paged_attention_triton
H, Hkv, d, S, Nb = 32, 4, 128, 16, 512
dev = "cuda"
k = torch.randn(Nb, S, Hkv, d, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
bt = torch.randperm(Nb, device=dev, dtype=torch.int32)[:64].view(1, 64)
def call(fn, L):
    q = torch.randn(1, H, d, device=dev, dtype=torch.bfloat16)
    return fn(q, k, v, bt, torch.tensor([L], device=dev, dtype=torch.int32), torch.tensor([0, 1], device=dev, dtype=torch.int32),
              torch.tensor([L - 1], device=dev), d ** -0.5, 1, L)
def ms(fn, lens, ctx=None):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for L in lens:
        if ctx is None: call(fn, L)
        else:
            with sdpa_kernel(ctx): call(fn, L)
    torch.cuda.synchronize(); return 1e3 * (time.perf_counter() - t0) / len(lens)
for name, fn, ctx in (("sdpa default", paged_attention_sdpa, None),
                      ("sdpa no cudnn", paged_attention_sdpa, [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
                      ("triton", paged_attention_triton, None)):
    base = 200 if "cudnn" not in name else 500
    ms(fn, [base - 1])  # compile/warm one shape
    print(f"{name:14s}: new length each call {ms(fn, list(range(base, base + 40))):.3f} ms/call, "
          f"same length {ms(fn, [base] * 40):.3f} ms/call", flush=True)
