"""Fused MoE kernels against their PyTorch references: the interpreter on small shapes (CPU), the
real shapes and a CUDA-graph capture on a GPU."""
import pytest
import torch

from moe_infer.experts.local_dispatch import LocalDispatcher
from moe_infer.experts.reference import EXPERT_BACKENDS
from moe_infer.experts.triton_experts import experts_triton
from moe_infer.kernels.fused_moe import block_schedule, fused_experts
from moe_infer.kernels.fused_moe_config import FusedMoEConfig, GemmConfig
from moe_infer.kernels.fused_moe_ref import block_schedule_ref, fused_experts_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = FusedMoEConfig(16, GemmConfig(16, 16), GemmConfig(32, 16))  # several K steps and N tiles


def _rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _weights(E, D, F, dtype, device=DEV, scale=None):
    w13 = torch.randn(E, 2 * F, D, device=device) * (scale or D ** -0.5)
    w2 = torch.randn(E, D, F, device=device) * (scale or F ** -0.5)
    return w13.to(dtype), w2.to(dtype)


def _routing(T, E_total, K, device=DEV):
    logits = torch.randn(T, E_total, device=device)
    w_TK, ids_TK = torch.softmax(logits, -1).topk(K, dim=-1)
    return ids_TK.int(), w_TK


@pytest.mark.parametrize("N,E,start,block_m", [(1, 1, 0, 16), (7, 3, 0, 16), (50, 5, 1, 32),
                                                (300, 9, 0, 16), (2000, 7, 2, 64), (5000, 130, 3, 16)])
def test_schedule_matches_reference(N, E, start, block_m):
    torch.manual_seed(N + E)
    ids_N = torch.randint(-1, E + start + 2, (N,), dtype=torch.int32, device=DEV)
    got, ref = block_schedule(ids_N, E, start, block_m), block_schedule_ref(ids_N.cpu(), E, start, block_m)
    num_padded = int(ref.num_padded_1)
    assert int(got.num_padded_1) == num_padded
    assert torch.equal(got.sorted_P[:num_padded].cpu(), ref.sorted_P[:num_padded])
    assert torch.equal(got.expert_B[:num_padded // block_m].cpu(), ref.expert_B[:num_padded // block_m])


@pytest.mark.parametrize("T,K,E,D,F,start,E_total", [
    (1, 1, 1, 16, 16, 0, 1), (5, 2, 3, 48, 40, 0, 3), (9, 8, 5, 32, 24, 0, 11),  # K 1..8, odd E, F
    (17, 3, 7, 40, 56, 2, 12),  # non-local experts on both sides
    (64, 4, 4, 32, 16, 0, 4), (4096, 1, 3, 16, 16, 0, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_matches_reference(T, K, E, D, F, start, E_total, dtype):
    torch.manual_seed(T * 31 + K)
    x_TD = torch.randn(T, D, device=DEV).to(dtype)
    ids_TK, w_TK = _routing(T, E_total, K)
    ids_TK[0, 0] = -1  # a dropped row
    w13, w2 = _weights(E, D, F, dtype)
    out = fused_experts(x_TD, ids_TK, w_TK, w13, w2, start, SMALL if T < 1000 else None)
    ref = fused_experts_ref(x_TD.float(), ids_TK, w_TK, w13.float(), w2.float(), start)
    assert _rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("N,E,start,block_m", [(1, 1, 0, 16), (46, 7, 2, 16), (64, 130, 3, 32)])
def test_inline_schedule_matches_launched_schedule(N, E, start, block_m):
    """Decode: the GEMMs derive the schedule from ids_N themselves; same act_PF and y_ND bits."""
    from moe_infer.kernels.fused_moe import down, gate_up

    torch.manual_seed(N)
    D, F = 32, 24
    ids_N = torch.randint(-1, E + start + 2, (N,), dtype=torch.int32, device=DEV)
    x_ND = torch.randn(N, D, device=DEV)
    w_N = torch.rand(N, device=DEV)
    w13, w2 = _weights(E, D, F, torch.float32)
    outs = []
    for inline in (False, True):
        sched = block_schedule(ids_N, E, start, block_m, backend="inline" if inline else "align")
        assert sched.is_inline == inline
        act_PF = gate_up(x_ND, w13, sched, 1, SMALL.gate_up)
        num_padded = int(block_schedule(ids_N, E, start, block_m).num_padded_1)
        outs.append((act_PF[:num_padded], down(act_PF, w2, w_N, sched, SMALL.down, torch.zeros(N, D, device=DEV))))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_tma_path_matches_reference(monkeypatch):
    """Weights (and the down GEMM's rows) through tensor descriptors; forced on in the interpreter."""
    import moe_infer.kernels.fused_moe as fused_moe

    if DEV == "cpu":
        monkeypatch.setattr(fused_moe, "_can_use_tma", lambda cfg, *tensors: cfg.use_tma)
    torch.manual_seed(5)
    T, K, E, D, F, start = 21, 3, 5, 48, 40, 1  # F, D not multiples of the tiles: edge tiles read past
    x_TD = torch.randn(T, D, device=DEV)
    ids_TK, w_TK = _routing(T, E + 2, K)
    w13, w2 = _weights(E, D, F, torch.float32)
    cfg = FusedMoEConfig(16, GemmConfig(16, 16, use_tma=True), GemmConfig(32, 16, use_tma=True))
    out = fused_moe.fused_experts(x_TD, ids_TK, w_TK, w13, w2, start, cfg)
    assert _rel_err(out, fused_experts_ref(x_TD, ids_TK, w_TK, w13, w2, start)) < 1e-5


@pytest.mark.parametrize("case", ["empty_experts", "one_expert", "none_local"])
def test_skewed_routing(case):
    torch.manual_seed(3)
    T, K, E, D, F = 23, 2, 6, 32, 16
    x_TD = torch.randn(T, D, device=DEV)
    ids_TK, w_TK = _routing(T, E, K)
    if case == "empty_experts":
        ids_TK = ids_TK % 2 * 3  # only experts 0 and 3 get rows
    elif case == "one_expert":
        ids_TK[:, 0], ids_TK[:, 1] = 4, -1
    w13, w2 = _weights(E, D, F, torch.float32)
    start = 6 if case == "none_local" else 0
    out = fused_experts(x_TD, ids_TK, w_TK, w13, w2, start, SMALL)
    ref = fused_experts_ref(x_TD, ids_TK, w_TK, w13, w2, start)
    if case == "none_local":
        assert torch.count_nonzero(out) == 0
    else:
        assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("start,num_local", [(0, 6), (0, 2), (2, 3), (5, 1)])
def test_backend_matches_torch_experts(start, num_local):
    torch.manual_seed(start + num_local)
    T, K, E, D, F = 9, 2, 6, 32, 24
    x_TD = torch.randn(T, D, device=DEV)
    ids_TK, w_TK = _routing(T, E, K)
    ids_TK[0, 1] = -1
    w13, w2 = _weights(num_local, D, F, torch.float32)
    disp = LocalDispatcher(E, num_local, start)
    x_RD, meta = disp.dispatch(x_TD, ids_TK, w_TK)
    y_RD = EXPERT_BACKENDS.get("triton")(x_RD, meta, w13, w2)
    ref_RD = EXPERT_BACKENDS.get("torch")(x_RD, meta, w13, w2)
    torch.testing.assert_close(y_RD, ref_RD, atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(y_RD[int(meta.offsets_E1[-1]):]) == 0


@pytest.mark.parametrize("num_local,start", [(9, 0), (4, 3)])
def test_moe_layer_takes_the_fused_path(num_local, start, monkeypatch):
    """MoELayer with experts="triton" and a plain LocalDispatcher runs fused_experts (no dispatch)."""
    from moe_infer.layers.moe import MoEBackends, MoELayer
    from moe_infer.routing.spec import RoutingSpec

    torch.manual_seed(num_local)
    spec = RoutingSpec(num_experts=9, top_k=3)
    layers = [MoELayer(0, 32, 24, spec, MoEBackends(experts=name, dispatcher=LocalDispatcher(9, num_local, start)),
                       torch.float32).to(DEV) for name in ("torch", "triton")]
    for p in layers[0].parameters():
        torch.nn.init.normal_(p, std=0.2)
    layers[1].load_state_dict(layers[0].state_dict())
    monkeypatch.setattr(layers[1].dispatcher, "dispatch", None)  # the fused path must not call it
    x_TD = torch.randn(13, 32, device=DEV)
    with torch.no_grad():
        assert _rel_err(layers[1](x_TD), layers[0](x_TD)) < 1e-5


def test_bad_input_is_named():
    w13, w2 = _weights(2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="w13_E2FD"):
        fused_experts(torch.randn(3, 32, device=DEV), torch.zeros(3, 1, dtype=torch.int32, device=DEV),
                      torch.ones(3, 1, device=DEV), w13, w2)
    with pytest.raises(ValueError, match="disagree"):
        fused_experts(torch.randn(3, 16, device=DEV), torch.zeros(2, 1, dtype=torch.int32, device=DEV),
                      torch.ones(2, 1, device=DEV), w13, w2)
    assert experts_triton is EXPERT_BACKENDS.get("triton")


MODEL_SHAPES = {"mixtral": (8, 2, 4096, 14336), "qwen3": (128, 8, 2048, 768),
                "olmoe": (64, 8, 2048, 1024), "deepseek_v3": (256, 8, 7168, 2048)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODEL_SHAPES))
@pytest.mark.parametrize("T", [1, 8, 100, 1024])
def test_model_shapes_on_gpu(name, T):
    E, K, D, F = MODEL_SHAPES[name]
    if name == "deepseek_v3":
        E = 64  # an EP rank's 64 of 256 experts: the same kernels, a quarter of the memory
    torch.manual_seed(T)
    x_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids_TK, w_TK = _routing(T, MODEL_SHAPES[name][0], K)
    w13, w2 = _weights(E, D, F, torch.bfloat16)
    out = fused_experts(x_TD, ids_TK, w_TK, w13, w2)
    ref = fused_experts_ref(x_TD, ids_TK, w_TK, w13, w2)
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_tile_variants_on_gpu(block_m, use_tma):
    E, K, D, F = 64, 8, 2048, 1024
    torch.manual_seed(block_m)
    x_TD = torch.randn(300, D, device="cuda", dtype=torch.bfloat16)
    ids_TK, w_TK = _routing(300, E, K)
    w13, w2 = _weights(E, D, F, torch.bfloat16)
    bn = 64 if block_m == 16 else 128
    cfg = FusedMoEConfig(block_m, GemmConfig(bn, 64, 8, 8 if block_m == 128 else 4, 3, use_tma),
                         GemmConfig(bn, 64, 8, 8 if block_m == 128 else 4, 3, use_tma))
    out = fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, cfg)
    assert _rel_err(out, fused_experts_ref(x_TD, ids_TK, w_TK, w13, w2)) < 1e-2


def assert_replays_on_new_routing(x_TD, ids_TK, w_TK, w13, w2, config=None, replays=3):
    """fused_experts (all experts local) captured in a CUDA graph, then replayed on fresh tokens and routing
    (the schedule is rebuilt on the device): every replay against the reference."""
    (T, K), E = ids_TK.shape, w13.shape[0]
    fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, config)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_TD = fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, config)
    for seed in range(replays):
        torch.manual_seed(seed)
        x_TD.copy_(torch.randn_like(x_TD))
        new_ids, new_w = _routing(T, E, K)
        ids_TK.copy_(new_ids)
        w_TK.copy_(new_w)
        graph.replay()
        assert _rel_err(out_TD, fused_experts_ref(x_TD, ids_TK, w_TK, w13, w2)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4096])
def test_cuda_graph_capture(T):
    E, K, D, F = 64, 8, 2048, 1024
    w13, w2 = _weights(E, D, F, torch.bfloat16)
    x_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids_TK, w_TK = _routing(T, E, K)
    assert_replays_on_new_routing(x_TD, ids_TK, w_TK, w13, w2)


@pytest.mark.gpu
def test_moe_layer_with_triton_experts_matches_torch():
    from moe_infer.layers.moe import MoEBackends, MoELayer
    from moe_infer.routing.spec import RoutingSpec

    torch.manual_seed(0)
    layers = [MoELayer(0, 256, 96, RoutingSpec(num_experts=9, top_k=3), MoEBackends(experts=name),
                       torch.bfloat16).cuda() for name in ("torch", "triton")]
    for p in layers[0].parameters():
        torch.nn.init.normal_(p, std=0.05)
    layers[1].load_state_dict(layers[0].state_dict())
    x_TD = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert _rel_err(layers[1](x_TD), layers[0](x_TD)) < 1e-2


@pytest.mark.gpu
def test_fp32_on_gpu_is_not_tf32():
    """float32 weights (the engine's fp32 parity runs) go through IEEE dots, not TF32."""
    torch.manual_seed(1)
    T, K, E, D, F = 64, 2, 8, 256, 160
    x_TD = torch.randn(T, D, device="cuda")
    ids_TK, w_TK = _routing(T, E, K)
    w13, w2 = _weights(E, D, F, torch.float32)
    out = fused_experts(x_TD, ids_TK, w_TK, w13, w2)
    ref = fused_experts_ref(x_TD.double(), ids_TK, w_TK, w13.double(), w2.double())
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("backend", ["align", "permute"])
@pytest.mark.parametrize("N,E,start,block_m", [(7, 3, 0, 16), (300, 9, 1, 32)])
def test_schedule_backends_agree(backend, N, E, start, block_m):
    """The routing permutation's layout and ours hold the same live slots (the GEMMs accept either)."""
    torch.manual_seed(N + 7)
    ids_N = torch.randint(-1, E + start + 2, (N,), dtype=torch.int32, device=DEV)
    got, ref = block_schedule(ids_N, E, start, block_m, backend=backend), block_schedule_ref(ids_N.cpu(), E, start, block_m)
    num_padded = int(ref.num_padded_1)
    assert int(got.num_padded_1) == num_padded and got.p_max >= num_padded
    assert torch.equal(got.sorted_P[:num_padded].cpu(), ref.sorted_P[:num_padded])
    assert torch.equal(got.expert_B[:num_padded // block_m].cpu(), ref.expert_B[:num_padded // block_m])


def test_auto_schedule_choice():
    from moe_infer.kernels.fused_moe_schedule import PERMUTE_MIN_ROWS, auto_schedule_backend

    assert auto_schedule_backend(8, 128, True) == "inline"  # qwen3 T=1
    assert auto_schedule_backend(8, 256, True) == "align"  # deepseek T=1: E_PAD work measured slower inline
    assert auto_schedule_backend(64, 128, True) == "align"  # qwen3 T=8
    assert auto_schedule_backend(8, 128, False) == "align"
    assert auto_schedule_backend(PERMUTE_MIN_ROWS, 8, True) == "permute"


@pytest.mark.parametrize("schedule,combine", [("permute", "tail"), ("inline", "tail"), ("align", "tail"),
                                              ("permute", "kernel")])
def test_schedule_and_combine_modes(schedule, combine):
    """Every schedule backend x combine mode: dropped rows, non-local experts, a token with no local row;
    the tail combine gives the same bits as the combine kernel."""
    import dataclasses

    torch.manual_seed(11)
    T, K, E, D, F, start = 13, 3, 5, 40, 24, 1
    x_TD = torch.randn(T, D, device=DEV)
    ids_TK, w_TK = _routing(T, E + 3, K)
    ids_TK[0, 0] = -1
    ids_TK[1] = 0  # token 1: no local expert (expert 0 < start)
    w13, w2 = _weights(E, D, F, torch.float32)
    cfg = dataclasses.replace(SMALL, schedule=schedule, combine=combine)
    out = fused_experts(x_TD, ids_TK, w_TK, w13, w2, start, cfg)
    assert torch.count_nonzero(out[1]) == 0
    assert _rel_err(out, fused_experts_ref(x_TD, ids_TK, w_TK, w13, w2, start)) < 1e-5
    base = fused_experts(x_TD, ids_TK, w_TK, w13, w2, start, dataclasses.replace(SMALL, schedule="align"))
    assert torch.equal(out, base)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 300])
def test_pdl_gives_the_same_bits(T, monkeypatch):
    """Programmatic dependent launch changes only when programs start, never the result."""
    E, K, D, F = 64, 8, 2048, 1024
    torch.manual_seed(T)
    x_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids_TK, w_TK = _routing(T, E, K)
    w13, w2 = _weights(E, D, F, torch.bfloat16)
    with_pdl = fused_experts(x_TD, ids_TK, w_TK, w13, w2)
    monkeypatch.setenv("MOE_FUSED_PDL", "0")
    assert torch.equal(with_pdl, fused_experts(x_TD, ids_TK, w_TK, w13, w2))


def test_down_tail_matches_its_reference():
    """down(..., tail=...) against down_ref with the same arguments: y_ND and the combined out_TD."""
    from moe_infer.kernels.fused_moe import TailCombine, down, gate_up
    from moe_infer.kernels.fused_moe_ref import down_ref

    torch.manual_seed(4)
    T, K, E, D, F, start = 11, 2, 4, 32, 24, 1
    ids_TK, w_TK = _routing(T, E + 2, K)
    x_TD = torch.randn(T, D, device=DEV)
    w13, w2 = _weights(E, D, F, torch.float32)
    sched = block_schedule(ids_TK.reshape(-1), E, start, 16)
    act_PF = gate_up(x_TD, w13, sched, K, SMALL.gate_up)
    outs = []
    for fn in (down, down_ref):
        tail = TailCombine(torch.zeros(T, D, device=DEV), ids_TK.contiguous(),
                           torch.zeros(T, -(-D // SMALL.down.block_n), dtype=torch.int32, device=DEV))
        y_ND = fn(act_PF, w2, w_TK.reshape(-1), sched, SMALL.down, torch.zeros(T * K, D, device=DEV), tail)
        outs.append((y_ND, tail.out_TD))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)

