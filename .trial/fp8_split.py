import torch, triton
from moe_infer.kernels import fp8_gemm
from moe_infer.kernels.fp8_ref import FP8_DTYPE
torch.manual_seed(0)
dev = "cuda"
def t_us(fn, n=200):
    g = torch.cuda.CUDAGraph()
    fn(); torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(20): fn()
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n // 20): g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000 / n
print("shape            T  split  fp8_us  bf16_us  fp8_GBs")
for N, K in [(4096, 7168), (24576, 1536), (7168, 16384), (1536, 7168), (32768, 512)]:
    w = (torch.randn(N, K, device=dev) * 0.1).to(FP8_DTYPE)
    s = torch.rand(triton.cdiv(N, 128), K // 128, device=dev) + 0.5
    wb = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    for T in [1, 16, 64]:
        x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
        tiles = fp8_gemm.gemm_tiles(T, N, K, 128, torch.cuda.get_device_properties(0).multi_processor_count)
        a = t_us(lambda: fp8_gemm.w8a8_block_gemm(x, w, s, 128, 128))
        orig = fp8_gemm.SPLIT_K_WAVES
        fp8_gemm.SPLIT_K_WAVES = 0
        a0 = t_us(lambda: fp8_gemm.w8a8_block_gemm(x, w, s, 128, 128))
        fp8_gemm.SPLIT_K_WAVES = orig
        b = t_us(lambda: x @ wb.t())
        print(f"{N:6d}x{K:<6d} {T:4d} {tiles.split_k:5d} {a:7.1f} (nosplit {a0:6.1f}) {b:7.1f} {N*K/a/1e3:7.0f}")
