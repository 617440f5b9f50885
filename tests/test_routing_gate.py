"""Fused Triton gating vs the PyTorch reference (interpreter on CPU, full shapes on a GPU), and the
grouped sigmoid router vs transformers' DeepseekV3 router."""
# conftest.py turns the Triton interpreter on when there is no CUDA device (before triton loads).
import pytest
import torch

pytest.importorskip("triton")

from moe_infer.routing.select import ROUTING_BACKENDS, select_experts_torch  # noqa: E402
from moe_infer.routing.spec import RoutingSpec  # noqa: E402
from moe_infer.routing.triton_select import select_experts_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _spec(E, K, kind):
    if kind == "grouped":  # DeepSeek-V3 style: sigmoid, bias, n_group, topk_group, scaling
        G = 8 if E % 8 == 0 else (2 if E % 2 == 0 else 1)
        return RoutingSpec(E, K, scoring="sigmoid", num_expert_group=G, topk_group=max(1, G // 2),
                           routed_scaling_factor=2.5, has_score_bias=True)
    if kind == "grouped_nobias":  # n_group without a score bias: a group's score is its best expert
        G = 4 if E % 4 == 0 else 2
        return RoutingSpec(E, K, scoring="softmax", num_expert_group=G, topk_group=2)
    if kind == "sigmoid":
        return RoutingSpec(E, K, scoring="sigmoid", renormalize=True)
    return RoutingSpec(E, K, scoring="softmax", renormalize=kind == "softmax_norm")


def _logits(T, E, dtype, ties, gen):
    if ties:  # a coarse grid: many exactly equal logits (and group sums) per row
        x = torch.randint(-6, 7, (T, E), generator=gen).float() / 4
    else:
        x = torch.randn(T, E, generator=gen) * 2
    return x.to(dtype).to(DEVICE)


def _check(T, E, K, kind, dtype, ties, seed):
    gen = torch.Generator().manual_seed(seed)
    spec = _spec(E, K, kind)
    x_TE = _logits(T, E, dtype, ties, gen)
    bias_E = None
    if spec.has_score_bias:  # with ties, a zero bias: sigmoid(a) + b1 + ... == sigmoid(c) + b2 + ... may hold
        # exactly in real numbers while fp32 rounds the two sides differently in each backend (seen on an H100)
        bias_E = torch.zeros(E) if ties else torch.randn(E, generator=gen) * 0.05
        bias_E = bias_E.to(DEVICE)
    w_ref, ids_ref = select_experts_torch(x_TE, spec, bias_E)
    w, ids = select_experts_triton(x_TE, spec, bias_E)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref), f"ids differ at rows {(ids != ids_ref).any(1).nonzero().flatten().tolist()}"
    torch.testing.assert_close(w, w_ref, atol=2e-6, rtol=1e-5)


CASES = [  # (E, K, kind): every E in {6, 8, 60, 128, 256} and K in {1, 2, 4, 8} appears
    (6, 1, "softmax_norm"), (6, 4, "softmax_raw"), (8, 2, "softmax_norm"), (8, 8, "sigmoid"),
    (60, 4, "softmax_raw"), (60, 8, "softmax_norm"), (128, 1, "sigmoid"), (128, 8, "softmax_norm"),
    (256, 8, "grouped"), (256, 2, "softmax_raw"), (64, 6, "grouped"), (60, 4, "grouped"),
    (128, 4, "grouped_nobias"), (6, 2, "grouped_nobias"),
]


@pytest.mark.parametrize("E,K,kind", CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_gate_matches_reference_interpreter(E, K, kind, ties):
    for i, T in enumerate((1, 5, 19)):
        _check(T, E, K, kind, torch.float32, ties, seed=E * 100 + K * 10 + i + 7 * ties)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gate_low_precision_logits(dtype):
    _check(9, 60, 4, "softmax_norm", dtype, False, seed=3)
    _check(9, 256, 8, "grouped", dtype, True, seed=4)


def test_gate_large_e_and_k():
    _check(3, 512, 16, "softmax_norm", torch.float32, True, seed=5)


def test_gate_strided_logits():
    x = torch.randn(7, 40, device=DEVICE)[:, 4:36]  # row stride 40, 32 experts
    spec = RoutingSpec(32, 4)
    assert torch.equal(select_experts_triton(x, spec)[1], select_experts_torch(x, spec)[1])


def test_gate_errors_name_the_problem():
    spec = RoutingSpec(8, 2)
    with pytest.raises(ValueError, match="spec says 8"):
        select_experts_triton(torch.randn(4, 6, device=DEVICE), spec)
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        select_experts_triton(torch.randn(4, 8, device=DEVICE).double(), spec)
    with pytest.raises(ValueError, match="score bias"):
        select_experts_triton(torch.randn(4, 8, device=DEVICE), spec, torch.zeros(5, device=DEVICE))
    assert ROUTING_BACKENDS.get("triton") is select_experts_triton


def test_grouped_routing_equals_transformers_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    cfg = DeepseekV3Config(hidden_size=64, n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=3,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.copy_(torch.randn(64) * 0.05)
    x = torch.randn(33, 64)
    with torch.no_grad():
        out = router(x)  # 5.x: (router_logits, topk_weights, topk_indices); pick by dtype/shape to be robust
        logits = torch.nn.functional.linear(x, router.weight)
        hf_ids = next(o for o in out if not o.is_floating_point())
        hf_w = next(o for o in out if o.is_floating_point() and o.shape == hf_ids.shape)
    spec = RoutingSpec(64, 6, scoring="sigmoid", num_expert_group=8, topk_group=3, routed_scaling_factor=2.5,
                       has_score_bias=True)
    bias = router.e_score_correction_bias.detach()
    for select in (select_experts_torch, select_experts_triton):
        w, ids = select(logits.to(DEVICE), spec, bias.to(DEVICE))
        hf_sorted, perm = hf_ids.long().sort(-1)
        ours_sorted, our_perm = ids.long().cpu().sort(-1)
        assert torch.equal(ours_sorted, hf_sorted)  # transformers' topk(sorted=False) order is arbitrary
        torch.testing.assert_close(w.cpu().gather(1, our_perm), hf_w.float().gather(1, perm), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("E,K,kind", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_full_shapes_gpu(E, K, kind, dtype):
    for i, T in enumerate((1, 33, 1000, 4096)):
        _check(T, E, K, kind, dtype, ties=i % 2 == 1, seed=E + K + i)
