"""The quality meter against torch's own KL divergence and cross entropy."""
import math

import pytest
import torch
import torch.nn.functional as F

from moe_infer.lab.quality import QualityMeter, next_token_targets


def test_meter_matches_torch_references():
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 50, (3, 8), generator=g)
    ref, test = torch.randn(24, 50, generator=g), torch.randn(24, 50, generator=g)
    meter = QualityMeter()
    for rows in (slice(0, 8), slice(8, 24)):  # accumulated over two batches
        meter.update(ref[rows], test[rows], next_token_targets(windows).reshape(-1)[rows])
    out = meter.result()
    kl = F.kl_div(F.log_softmax(test, -1), F.log_softmax(ref, -1), log_target=True, reduction="sum") / 24
    assert out["kl"] == pytest.approx(float(kl), rel=1e-6)
    assert out["top1_agreement"] == pytest.approx(float((ref.argmax(-1) == test.argmax(-1)).float().mean()))
    tgt = windows[:, 1:].reshape(-1)
    keep = torch.ones(3, 8, dtype=torch.bool)
    keep[:, -1] = False  # the last position of a window has no next token
    for key, logits in (("ppl", test), ("ppl_dropless", ref)):
        assert out[key] == pytest.approx(math.exp(float(F.cross_entropy(logits[keep.reshape(-1)], tgt))), rel=1e-6)
    same = QualityMeter()
    same.update(ref, ref.clone(), next_token_targets(windows))
    assert same.result()["kl"] == pytest.approx(0.0, abs=1e-12) and same.result()["top1_agreement"] == 1.0
