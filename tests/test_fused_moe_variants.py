"""The fused MoE GEMMs' variants against the per-tile kernels they stand in for: persistent GEMMs (one program per
SM), gate_up as one dot (`GemmConfig.one_dot`), on the CPU interpreter and on a GPU; and the committed tuned files."""
import pytest
import torch

from moe_infer.kernels.fused_moe import block_schedule, fused_experts
from moe_infer.kernels.fused_moe_config import FusedMoEConfig, GemmConfig
from moe_infer.kernels.fused_moe_ref import fused_experts_ref
from test_fused_moe import DEV, _rel_err, _routing, _weights, assert_replays_on_new_routing


def _olmoe_inputs_on_gpu(T: int, seed: int):
    """(x_TD, ids_TK, w_TK, w13, w2) of the OLMoE expert shape (E=64, K=8, D=2048, F=1024) in bf16 on the GPU."""
    E, K, D, F = 64, 8, 2048, 1024
    torch.manual_seed(seed)
    x_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids_TK, w_TK = _routing(T, E, K)
    return (x_TD, ids_TK, w_TK, *_weights(E, D, F, torch.bfloat16))


@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("use_tma", [False, True])
def test_persistent_gemms_give_the_same_bits(flatten, use_tma, monkeypatch):
    """One program per SM looping over the tiles (4 programs on CPU): the same bits as one program a tile,
    with more tiles than programs, skewed experts, a dropped row, non-local experts and edge tiles."""
    import moe_infer.kernels.fused_moe as fused_moe

    if DEV == "cpu":
        monkeypatch.setattr(fused_moe, "_can_use_tma", lambda cfg, *tensors: cfg.use_tma)
    torch.manual_seed(11)
    T, K, E, D, F, start = 37, 3, 5, 48, 40, 1
    x_TD = torch.randn(T, D, device=DEV)
    ids_TK, w_TK = _routing(T, E + 2, K)
    ids_TK[:20, 0] = start + 2  # one expert with several tiles
    ids_TK[3, 1] = -1
    w13, w2 = _weights(E, D, F, torch.float32)
    grids = []
    for name in ("gate_up_persistent_kernel", "down_persistent_kernel"):
        kernel = getattr(fused_moe, name)
        monkeypatch.setattr(fused_moe, name, type("Spy", (), {
            "__getitem__": lambda self, grid, kernel=kernel: grids.append(grid) or kernel[grid]})())
    outs = []
    for persistent in (False, True):
        gemm = [GemmConfig(16, 16, 2, use_tma=use_tma, persistent=persistent, flatten=flatten),
                GemmConfig(32, 16, 2, use_tma=use_tma, persistent=persistent, flatten=flatten)]
        outs.append(fused_moe.fused_experts(x_TD, ids_TK, w_TK, w13, w2, start, FusedMoEConfig(16, *gemm, schedule="align")))
    assert len(grids) == 2 and grids[0][0] < 7  # both GEMMs ran persistent, fewer programs than tiles
    assert torch.equal(outs[0], outs[1])
    assert _rel_err(outs[1], fused_experts_ref(x_TD, ids_TK, w_TK, w13, w2, start)) < 1e-5


@pytest.mark.parametrize("persistent", [False, True])
def test_gate_up_as_one_dot_gives_the_same_bits(persistent, monkeypatch):
    """gate_up's gate and up tiles in one [1, 2, BLOCK_N, BLOCK_K] load and one dot (GemmConfig.one_dot):
    two dots' result, F not a multiple of BLOCK_N (the last tile's rows past F read zeros). The interpreter's
    numpy dot sums a [16, 32] product in another order than two [16, 16] ones (1e-6 apart in float32); the
    GPU test below checks the bits."""
    import moe_infer.kernels.fused_moe as fused_moe

    if DEV == "cpu":
        monkeypatch.setattr(fused_moe, "_can_use_tma", lambda cfg, *tensors: cfg.use_tma)
    one_dot_args = []
    for name in ("gate_up_kernel", "gate_up_persistent_kernel"):
        def launcher(grid, kernel=getattr(fused_moe, name)):
            return lambda *args, **kwargs: one_dot_args.append(kwargs["ONE_DOT"]) or kernel[grid](*args, **kwargs)
        monkeypatch.setattr(fused_moe, name, type("Spy", (), {"__getitem__": lambda self, grid, f=launcher: f(grid)})())
    torch.manual_seed(13)
    T, K, E, D, F, start = 29, 2, 4, 48, 40, 0
    x_TD = torch.randn(T, D, device=DEV)
    ids_TK, w_TK = _routing(T, E, K)
    w13, w2 = _weights(E, D, F, torch.float32)
    sched = block_schedule(ids_TK.reshape(-1), E, start, 16, backend="align")
    num_padded = int(sched.num_padded_1)
    acts = [fused_moe.gate_up(x_TD, w13, sched, K, GemmConfig(16, 16, 2, use_tma=True, persistent=persistent,
                                                                one_dot=one_dot))[:num_padded]
            for one_dot in (False, True)]
    torch.testing.assert_close(acts[1], acts[0], rtol=1e-5, atol=1e-5)
    cfg = FusedMoEConfig(16, GemmConfig(16, 16, 2, use_tma=True, persistent=persistent, one_dot=True),
                         GemmConfig(32, 16, 2), schedule="align")
    out = fused_moe.fused_experts(x_TD, ids_TK, w_TK, w13, w2, start, cfg)
    assert _rel_err(out, fused_experts_ref(x_TD, ids_TK, w_TK, w13, w2, start)) < 1e-5
    assert one_dot_args == [False, True, True]


def test_warp_specialize_is_checked_and_reaches_the_down_kernel_only_with_tma(monkeypatch):
    """GemmConfig.warp_specialize: only a persistent, flattened TMA down GEMM of 8 warps takes it (a clear error
    otherwise, and for gate_up), and the kernel gets it only where the tensors take TMA (on the interpreter the
    flag changes nothing; the GPU test below checks the bits)."""
    import moe_infer.kernels.fused_moe as fused_moe

    ws = dict(use_tma=True, persistent=True, flatten=True, warp_specialize=True)
    for bad in (dict(ws, persistent=False), dict(ws, flatten=False), dict(ws, use_tma=False)):
        with pytest.raises(ValueError, match="warp_specialize needs"):
            GemmConfig(32, 16, 2, 8, **bad)
    with pytest.raises(ValueError, match="warp_specialize needs"):
        GemmConfig(32, 16, 2, 4, **ws)
    with pytest.raises(ValueError, match="down GEMM only"):
        FusedMoEConfig(16, GemmConfig(32, 16, 2, 8, **ws), GemmConfig(32, 16, 2))
    ws_args = []

    def launcher(grid, kernel=fused_moe.down_persistent_kernel):
        return lambda *args, **kwargs: ws_args.append(kwargs["WARP_SPECIALIZE"]) or kernel[grid](*args, **kwargs)
    monkeypatch.setattr(fused_moe, "down_persistent_kernel", type("Spy", (), {"__getitem__": lambda self, grid: launcher(grid)})())
    torch.manual_seed(17)
    T, K, E, D, F = 29, 2, 4, 48, 40
    x_TD = torch.randn(T, D, device=DEV)
    ids_TK, w_TK = _routing(T, E, K)
    w13, w2 = _weights(E, D, F, torch.float32)
    cfg = FusedMoEConfig(16, GemmConfig(16, 16, 2), GemmConfig(32, 16, 2, 8, **ws), schedule="align")
    ref = fused_experts_ref(x_TD, ids_TK, w_TK, w13, w2)
    for tma in (False, True):
        monkeypatch.setattr(fused_moe, "_can_use_tma", lambda cfg, *tensors, tma=tma: cfg.use_tma and tma)
        assert _rel_err(fused_moe.fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, cfg), ref) < 1e-5
    assert ws_args == [False, True]



@pytest.mark.gpu
@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("T", [300, 4096])
def test_persistent_gemms_on_gpu(T, use_tma):
    """The persistent prefill GEMMs (one program per SM) give the bits of one program per tile, and capture."""
    x_TD, ids_TK, w_TK, w13, w2 = _olmoe_inputs_on_gpu(T, seed=T)
    outs = []
    for persistent in (False, True):
        gemm = [GemmConfig(bn, 64, 8, 8, 3, use_tma, persistent=persistent) for bn in (128, 256)]
        cfg = FusedMoEConfig(128, *gemm)
        outs.append(fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, cfg))
    assert torch.equal(outs[0], outs[1])
    assert_replays_on_new_routing(x_TD, ids_TK, w_TK, w13, w2, cfg, replays=1)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [300, 4096])
def test_warp_specialized_down_on_gpu(T):
    """The persistent TMA down GEMM with its tile loop warp-specialised (GemmConfig.warp_specialize): the bits of
    the plain loop, and it captures."""
    x_TD, ids_TK, w_TK, w13, w2 = _olmoe_inputs_on_gpu(T, seed=T + 2)
    cfgs = [FusedMoEConfig(128, GemmConfig(128, 64, 8, 8, 3, True), GemmConfig(256, 64, 8, 8, 4, True, persistent=True,
                                                                               warp_specialize=ws)) for ws in (False, True)]
    outs = [fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, cfg) for cfg in cfgs]
    assert torch.equal(outs[0], outs[1])
    assert_replays_on_new_routing(x_TD, ids_TK, w_TK, w13, w2, cfgs[1], replays=2)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("T", [300, 4096])
def test_gate_up_one_dot_on_gpu(T, persistent):
    """gate_up's gate and up tiles in one TMA load and one dot (GemmConfig.one_dot): the bits of two dots."""
    x_TD, ids_TK, w_TK, w13, w2 = _olmoe_inputs_on_gpu(T, seed=T + 1)
    outs = [fused_experts(x_TD, ids_TK, w_TK, w13, w2, 0, FusedMoEConfig(
        128, GemmConfig(128, 64, 8, 8, 3, True, persistent=persistent, one_dot=one_dot), GemmConfig(256, 64, 8, 8, 3, True)))
        for one_dot in (False, True)]
    assert torch.equal(outs[0], outs[1])


def test_every_tuned_config_file_reads():
    """The committed tuned files (all devices) parse into typed configs: a bad field or value fails here,
    not on the first prefill step of a GPU run."""
    import glob
    import json
    import os

    from moe_infer.kernels.fused_moe_config import CONFIG_DIR, FusedMoEConfig

    paths = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.json")))
    assert paths
    for path in paths:
        with open(path) as f:
            for key, value in json.load(f).items():
                cfg = FusedMoEConfig.from_dict(value)
                assert int(key) >= 1 and cfg.block_m >= 16, path
                assert all(isinstance(getattr(g, name), bool) for g in (cfg.gate_up, cfg.down)
                           for name in ("use_tma", "persistent", "flatten", "one_dot", "warp_specialize")), (path, key)
