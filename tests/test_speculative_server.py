"""Speculative decoding's metrics on the server's /metrics (read from the engine's get_stats, through the engine
core process as `moe-infer serve` runs it)."""
from __future__ import annotations

import httpx
import pytest

from server_fixtures import MODEL, live_server

pytestmark = pytest.mark.timeout(300)


def test_spec_decode_metrics():
    from prometheus_client.parser import text_string_to_metric_families
    import openai

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with live_server(speculative_config=spec) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none")
        out = client.completions.create(model=MODEL, prompt="one two three one two three one two three one two",
                                        max_tokens=16, temperature=0.0)
        assert out.choices[0].text
        srv.wait_idle()
        stats = srv.utility("stats")[0]
        text = httpx.get(f"{srv.url}/metrics").text
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert stats.num_spec_proposed_tokens > 0
    assert samples["moe_infer:spec_decode_num_draft_tokens_total"] == stats.num_spec_proposed_tokens
    assert samples["moe_infer:spec_decode_num_accepted_tokens_total"] == stats.num_spec_accepted_tokens
    assert samples["moe_infer:spec_decode_num_drafts_total"] == stats.num_spec_verified
    assert samples["moe_infer:spec_decode_acceptance_rate"] == pytest.approx(stats.spec_acceptance_rate)
    assert samples["moe_infer:spec_decode_mean_accepted_length"] == pytest.approx(stats.spec_mean_accepted_length)
