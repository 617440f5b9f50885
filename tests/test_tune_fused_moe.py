"""scripts/tune_fused_moe.py on CPU: shapes named or given as E:K:D:F, and the candidate lists of its options."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tuner():
    spec = importlib.util.spec_from_file_location("tune_fused_moe", os.path.join(ROOT, "scripts", "tune_fused_moe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shapes_by_name_or_numbers_and_a_clear_error():
    tuner = _tuner()
    assert tuner.parse_shape("qwen3-30b-a3b") == (128, 8, 2048, 768)
    assert tuner.parse_shape("60:4:2048:1408") == (60, 4, 2048, 1408)
    for bad in ("qwen3", "60:4:2048", "60:0:2048:1408", "a:b:c:d"):
        with pytest.raises(SystemExit, match="E:K:D:F"):
            tuner.parse_shape(bad)


def test_bad_token_counts_and_gain_are_named(monkeypatch):
    import sys

    tuner = _tuner()
    assert tuner.parse_tokens("2048,8192") == [2048, 8192]
    for bad in ("2048,abc", "0", "2048,", "-1"):
        with pytest.raises(SystemExit, match="--tokens"):
            tuner.parse_tokens(bad)
    monkeypatch.setattr(sys, "argv", ["tune_fused_moe.py", "--refine", "--min-gain", "2"])
    with pytest.raises(SystemExit, match="--min-gain"):
        tuner.main()


def test_candidates_of_the_options():
    tuner = _tuner()
    cands = tuner.GATE_UP[128]
    plain = list(tuner.candidates(cands, 128, persistent=False))
    assert len(plain) == len(cands) and not any(c.persistent or c.one_dot for c in plain)
    both = list(tuner.candidates(cands, 128, persistent=True, one_dot=True))
    assert len(both) == 6 * len(cands)  # plain and one dot, each as tiles, persistent, persistent flattened
    assert all(c.use_tma for c in both if c.one_dot)
    assert {(c.persistent, c.flatten) for c in both} == {(False, True), (True, False), (True, True)}
    decode = list(tuner.candidates(tuner.GATE_UP[16], 16, persistent=True))  # decode tiles: never persistent
    assert not any(c.persistent for c in decode)


def test_refine_toggles_only_the_options():
    """--refine: the config in use first, then its tiles with one dot or two (gate_up), one program a tile or
    persistent, flattened or not (BLOCK_M >= 64 only); flatten without persistent is not a new variant."""
    from moe_infer.kernels.fused_moe_config import GemmConfig

    tuner = _tuner()
    base = GemmConfig(128, 64, 8, 8, 3, use_tma=False, persistent=True, flatten=False)
    gate_up = tuner.option_variants(base, 128, is_gate_up=True)
    assert gate_up[0] == base and len(gate_up) == 6
    assert all((c.block_n, c.block_k, c.group_m, c.num_warps, c.num_stages) == (128, 64, 8, 8, 3) for c in gate_up)
    assert {(c.one_dot, c.persistent, c.flatten if c.persistent else None) for c in gate_up} == {
        (d, p, f) for d in (False, True) for p, f in ((False, None), (True, False), (True, True))}
    assert all(c.use_tma for c in gate_up if c.one_dot)
    down = tuner.option_variants(GemmConfig(256, 64, 8, 8, 4, use_tma=True), 128, is_gate_up=False)
    assert len(down) == 4 and not any(c.one_dot for c in down)  # tiles, persistent, flattened, + warp-specialised
    assert [(c.persistent, c.flatten) for c in down if c.warp_specialize] == [(True, True)]
    assert not any(c.warp_specialize for c in gate_up)  # gate_up's rows are pointer loads
    ws = tuner.option_variants(down[-1], 128, is_gate_up=False)  # from a warp-specialised one
    assert ws[0].warp_specialize and len(ws) == 4 and sum(c.warp_specialize for c in ws) == 1
    no_tma = tuner.option_variants(GemmConfig(256, 64, 8, 8, 4), 128, is_gate_up=False)  # pointer loads: never
    assert len(no_tma) == 3 and not any(c.warp_specialize for c in no_tma)
    four = tuner.option_variants(GemmConfig(256, 64, 8, 4, 4, use_tma=True), 128, is_gate_up=False)  # 4 warps: never
    assert not any(c.warp_specialize for c in four)
    assert len(tuner.option_variants(GemmConfig(64, 128), 16, is_gate_up=True)) == 2  # decode: never persistent
    assert len(tuner.option_variants(GemmConfig(64, 128), 16, is_gate_up=False)) == 1


def test_refined_config_needs_every_round():
    tuner = _tuner()
    assert tuner.keep_refined([100.0, 104.0], [95.0, 99.0], 0.02)
    assert not tuner.keep_refined([100.0, 104.0], [95.0, 103.0], 0.02)  # one round within the spread
    assert not tuner.keep_refined([100.0, 100.0], [99.0, 99.0], 0.02)  # faster, not by the margin
    assert not tuner.keep_refined([], [], 0.02)


def test_a_partial_tuning_keeps_the_other_token_counts(tmp_path, monkeypatch):
    """Tuning some token counts into an existing file keeps its other entries (a file of only 2048 and 8192
    would serve decode with a prefill tile); --replace writes only what was tuned."""
    import json
    import sys

    from moe_infer.kernels.fused_moe_config import FusedMoEConfig, GemmConfig, config_file_name

    tuner = _tuner()
    old = FusedMoEConfig(16, GemmConfig(64, 128), GemmConfig(64, 128)).to_dict()
    new = FusedMoEConfig(128, GemmConfig(128, 64, 8, 8, 3), GemmConfig(256, 64, 8, 8, 4)).to_dict()
    path = tmp_path / config_file_name(8, 64, 32, "bf16", "cpu")
    path.write_text(json.dumps({"1": old, "2048": old}))
    monkeypatch.setattr(tuner, "make_weights", lambda E, D, F: (None, None))
    monkeypatch.setattr(tuner, "device_name", lambda: "cpu")
    monkeypatch.setattr(tuner.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(tuner, "tune_point", lambda T, *a: (1.0, FusedMoEConfig.from_dict(new)))
    argv = ["tune_fused_moe.py", "--shapes", "8:2:32:64", "--tokens", "2048,8192", "--out-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    tuner.main()
    table = json.loads(path.read_text())
    assert list(table) == ["1", "2048", "8192"] and table["1"] == old and table["2048"] == table["8192"] == new
    monkeypatch.setattr(sys, "argv", argv + ["--replace"])
    tuner.main()
    assert list(json.loads(path.read_text())) == ["2048", "8192"]


def test_refine_into_another_folder_writes_the_whole_table(tmp_path, monkeypatch):
    """--refine with --out-dir where no file exists yet: the committed table's other token counts come along,
    so the file can replace the committed one as it is."""
    import json
    import sys

    from moe_infer.kernels.fused_moe_config import FusedMoEConfig, GemmConfig, config_file_name

    tuner = _tuner()
    old = FusedMoEConfig(16, GemmConfig(64, 128), GemmConfig(64, 128))
    new = FusedMoEConfig(128, GemmConfig(128, 64, 8, 8, 3, use_tma=True, one_dot=True), GemmConfig(256, 64, 8, 8, 4))
    monkeypatch.setattr(tuner, "make_weights", lambda E, D, F: (None, None))
    monkeypatch.setattr(tuner, "device_name", lambda: "cpu")
    monkeypatch.setattr(tuner.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(tuner, "load_configs", lambda *a: {1: old, 2048: old})
    monkeypatch.setattr(tuner, "refine_point", lambda T, *a: (old, new, [2.0, 2.0], [1.0, 1.0], True))
    monkeypatch.setattr(sys, "argv", ["tune_fused_moe.py", "--refine", "--shapes", "8:2:32:64", "--tokens", "2048",
                                      "--out-dir", str(tmp_path)])
    tuner.main()
    table = json.loads((tmp_path / config_file_name(8, 64, 32, "bf16", "cpu")).read_text())
    assert list(table) == ["1", "2048"] and table["1"] == old.to_dict() and table["2048"] == new.to_dict()


def test_w4_format_options(monkeypatch, tmp_path):
    """--format refuses the bf16-only options; the 4-bit tuner's file name is the one `w4_config` reads."""
    import json
    import sys

    from moe_infer.kernels import fused_moe_config
    from moe_infer.kernels.fused_moe_w4a16 import format_name, w4_config

    tuner = _tuner()
    monkeypatch.setattr(sys, "argv", ["tune_fused_moe.py", "--format", "int4_g128", "--refine"])
    with pytest.raises(SystemExit, match="W4A16 kernels have no"):
        tuner.main()
    assert {format_name("int4", 128), format_name("int4", 32), format_name("mxfp4", 32)} == set(tuner.W4_FORMATS)
    cfg = fused_moe_config.FusedMoEConfig(32, fused_moe_config.GemmConfig(32, 64), fused_moe_config.GemmConfig(64, 32))
    name = fused_moe_config.config_file_name(8, 64, 128, "int4_g128", fused_moe_config.device_name())
    (tmp_path / name).write_text(json.dumps({"16": cfg.to_dict()}))
    monkeypatch.setattr(fused_moe_config, "CONFIG_DIR", str(tmp_path))
    fused_moe_config.load_configs.cache_clear()
    try:
        assert w4_config(20, 8, 64, 128, 2, "int4_g128") == cfg  # the nearest token count's entry
        assert w4_config(20, 8, 64, 128, 2, "mxfp4") != cfg  # another format: the heuristic
    finally:
        fused_moe_config.load_configs.cache_clear()


def test_fp8_format_candidates_and_the_file_fp8_tiles_reads(monkeypatch, tmp_path):
    """--format fp8_w8a8: the bf16-only options refused; each candidate survives the file round trip (MoETiles ->
    FusedMoEConfig -> MoETiles) with its column / K tiles at the 128 block; `fp8_tiles` takes the nearest token
    count's entry of the file named as the tuner names it, and without a file (or another block size) `moe_tiles`."""
    import json
    import sys

    from moe_infer.kernels import fused_moe_config, fused_moe_fp8

    tuner = _tuner()
    monkeypatch.setattr(sys, "argv", ["tune_fused_moe.py", "--format", "fp8_w8a8", "--one-dot"])
    with pytest.raises(SystemExit, match="W8A8 kernels have no"):
        tuner.main()
    assert fused_moe_fp8.fp8_config_name(tuner.FP8_BLOCK, tuner.FP8_BLOCK) == tuner.FP8_FORMAT
    for block_m in (16, 32, 64, 128):
        gate_ups, downs = tuner.fp8_candidates(block_m)
        cands = [t for gu in gate_ups for t in downs(gu)]
        assert len(gate_ups) == 3 and len(cands) == 12 and len(set(cands)) == 12
        for tiles in cands:
            cfg = tiles.to_config(128)
            assert cfg.gate_up.block_n == cfg.gate_up.block_k == cfg.down.block_k == 128
            assert fused_moe_fp8.MoETiles.from_config(fused_moe_config.FusedMoEConfig.from_dict(cfg.to_dict())) == tiles
    E, F, D, K = 16, 256, 512, 4
    small = fused_moe_fp8.MoETiles(16, 64, 1, 4, 4, 8, 3)
    large = fused_moe_fp8.MoETiles(64, 128, 8, 8, 3, 4, 4)
    name = fused_moe_config.config_file_name(E, F, D, "fp8_w8a8", fused_moe_config.device_name())
    (tmp_path / name).write_text(json.dumps({"1": small.to_config(128).to_dict(),
                                             "512": large.to_config(128).to_dict()}))
    monkeypatch.setattr(fused_moe_config, "CONFIG_DIR", str(tmp_path))
    fused_moe_config.load_configs.cache_clear()
    try:
        assert fused_moe_fp8.fp8_tiles(1, E, F, D, K, 128, 128) == small
        assert fused_moe_fp8.fp8_tiles(200, E, F, D, K, 128, 128) == small  # nearer to 1 than to 512
        assert fused_moe_fp8.fp8_tiles(300, E, F, D, K, 128, 128) == large
        assert fused_moe_fp8.fp8_tiles(300, E, F, D, K, 64, 64) == fused_moe_fp8.moe_tiles(300 * K, E)  # no file
        assert fused_moe_fp8.fp8_tiles(300, E, F, 2 * D, K, 128, 128) == fused_moe_fp8.moe_tiles(300 * K, E)
        bad = dict(small.to_config(128).to_dict(), down=dict(small.to_config(128).to_dict()["down"], block_k=64))
        (tmp_path / name).write_text(json.dumps({"1": bad}))
        fused_moe_config.load_configs.cache_clear()
        with pytest.raises(ValueError, match="block_k=128"):
            fused_moe_fp8.fp8_tiles(1, E, F, D, K, 128, 128)
    finally:
        fused_moe_config.load_configs.cache_clear()
