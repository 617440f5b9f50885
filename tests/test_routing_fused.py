"""Fused gate + permutation (`route_rows_triton`) vs the PyTorch references: the same top-k and the same
RowPermutation / BlockLayout, bit for bit (interpreter on CPU with small shapes, full shapes on a GPU)."""
# conftest.py turns the Triton interpreter on when there is no CUDA device (before triton loads).
import pytest
import torch

pytest.importorskip("triton")

from moe_infer.routing.permute import permute_rows_torch  # noqa: E402
from moe_infer.routing.select import select_experts_torch  # noqa: E402
from moe_infer.routing.spec import RoutingSpec  # noqa: E402
from moe_infer.routing.triton_route import fused_launch_config, route_rows_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPECS = {
    "mixtral": RoutingSpec(8, 2),
    "olmoe": RoutingSpec(64, 8, renormalize=False),
    "deepseek": RoutingSpec(256, 8, scoring="sigmoid", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5,
                            has_score_bias=True),
    "odd_k": RoutingSpec(60, 3),  # K not a power of 2: the two-step path
    "grouped_nobias": RoutingSpec(32, 4, num_expert_group=4, topk_group=2),
}


def _check(spec, T, block_size, dtype, ties, seed, **tuning):
    gen = torch.Generator().manual_seed(seed)
    E = spec.num_experts
    x = torch.randint(-3, 4, (T, E), generator=gen).float() / 2 if ties else torch.randn(T, E, generator=gen)
    x_TE = x.to(dtype).to(DEVICE)
    bias_E = None
    if spec.has_score_bias:  # zero with ties: see test_routing_gate._check
        bias_E = (torch.zeros(E) if ties else torch.randn(E, generator=gen) * 0.05).to(DEVICE)
    w, ids, perm = route_rows_triton(x_TE, spec, bias_E, block_size, **tuning)
    w_ref, ids_ref = select_experts_torch(x_TE, spec, bias_E)
    ref = permute_rows_torch(ids_ref, w_ref, E, 0, block_size)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=2e-6, rtol=1e-5)
    for f in ("order_R", "inv_N", "token_idx_R", "counts_E", "offsets_E1"):
        assert torch.equal(getattr(perm, f), getattr(ref, f)), f
    torch.testing.assert_close(perm.weights_R, ref.weights_R, atol=2e-6, rtol=1e-5)
    assert (perm.layout is None) == (block_size is None)
    if block_size is not None:
        for f in ("sorted_rows_P", "block_expert_B", "padded_offsets_E1", "num_padded"):
            assert torch.equal(getattr(perm.layout, f), getattr(ref.layout, f)), f


TUNINGS = {  # one-warp gate tiles summed per group (default; small groups: several groups and tiles), wide tiles
    "grouped": dict(group_rows=32, rows_per_scatter=64), "wide": dict(wide_gate=True, rows_per_scatter=256),
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("tuning", list(TUNINGS))
def test_fused_route_matches_references_interpreter(name, ties, tuning):
    spec = SPECS[name]
    for i, T in enumerate((1, 7, 40)):  # 40 tokens: several tiles for every spec
        _check(spec, T, (None, 16, 4)[i], torch.bfloat16 if i == 2 else torch.float32, ties, seed=i + 10 * ties,
               **TUNINGS[tuning])


def test_fused_tiles_are_powers_of_two():
    for T in (1, 3, 100, 8192):
        for E, K in ((8, 2), (64, 8), (128, 8), (256, 8), (512, 16)):
            block_t, num_warps = fused_launch_config(T, E, K)
            assert block_t & (block_t - 1) == 0 and 1 <= num_warps <= 8 and block_t * K <= 1024


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("tuning", [{}, dict(wide_gate=True)])
def test_fused_route_full_shapes_gpu(name, tuning):
    for i, T in enumerate((1, 33, 1000, 8192)):
        for block_size in (None, 64):
            _check(SPECS[name], T, block_size, (torch.float32, torch.bfloat16)[i % 2], ties=i == 2, seed=i, **tuning)


def _zeroed_buffers():
    from moe_infer.routing.triton_route import kept_zero_buffers

    return kept_zero_buffers(torch.device(DEVICE))


def test_group_counts_buffer_is_zero_between_calls():
    """The fused path's group counts live in a kept buffer that its scatter re-zeroes (no memset launch):
    after calls of growing and shrinking sizes the buffer is all zero and every result is still right."""
    from moe_infer.routing.triton_route import zeroed_group_counts

    bufs = _zeroed_buffers()
    bufs.clear()
    for i, T in enumerate((40, 9, 70, 40)):  # 32-row groups (2 tiles of 16), 2 groups per scatter program
        _check(SPECS["deepseek"], T, 16, torch.float32, ties=i % 2 == 1, seed=30 + i, group_rows=32,
               rows_per_scatter=64)
        assert bufs and all(int(b.abs().sum()) == 0 for b in bufs)
    assert bufs[-1].numel() >= -(-70 * 8 // 32) * 256  # the kept buffer was used, and grew to 70 tokens' groups
    flat, is_shared = zeroed_group_counts(8, DEVICE)
    assert is_shared and flat.numel() == 8 and int(flat.abs().sum()) == 0


def test_fused_route_scatter_smaller_than_a_group_zeroes_a_fresh_buffer():
    # 64-row groups read by several 32-row scatter programs: none may re-zero them (a memset per call)
    bufs = _zeroed_buffers()
    bufs.clear()
    _check(SPECS["deepseek"], 40, 16, torch.float32, ties=False, seed=3, group_rows=64, rows_per_scatter=32)
    assert not bufs
