"""GET /metrics: Prometheus metrics (prometheus-client), read from the engine.

Latency histograms are observed as each request finishes, from the engine's own RequestMetrics
(the engine's `on_finished` hook); the scheduler, KV-cache, prefix-cache and expert-load series are
read from the engine at scrape time, on the engine's loop between two steps (`LLMEngine.get_stats`,
`get_expert_load`: one host sync for the expert counters). With several server processes
(`serve.api_server_count`) the histograms and counters are prometheus-client's multiprocess values, summed
over the processes at scrape time, and num_requests_in_flight counts every process's requests. Names
(vLLM's style, `moe_infer:` prefix):

    time_to_first_token_seconds, time_per_output_token_seconds, e2e_request_latency_seconds   histograms
    requests_finished_total{finished_reason}, requests_rejected_total{reason},
    prompt_tokens_total, generation_tokens_total                                              counters
    num_requests_running, num_requests_waiting (sequences), num_requests_in_flight (HTTP-side),
    kv_cache_usage_perc, num_kv_blocks, num_kv_blocks_used, prefix_cache_hit_rate             gauges
    prefix_cache_queries_total, prefix_cache_hits_total (blocks), num_preemptions_total       counters
    spec_decode_num_draft_tokens_total, spec_decode_num_accepted_tokens_total,
    spec_decode_num_drafts_total (sequence-steps that verified proposals)                     counters
    spec_decode_acceptance_rate, spec_decode_mean_accepted_length (since start)               gauges
        (speculative decoding: docs/speculative.md; 0 without it)
    expert_routed_tokens_total, expert_dropped_tokens_total, expert_rerouted_tokens_total
        {layer, expert}: token-to-expert assignments since start                              counters
    expert_load_imbalance{layer}: max / mean routed per expert                                gauge
"""
from __future__ import annotations

import logging
import os

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moe_infer.engine.outputs import RequestOutput
from moe_infer.server.serving import get_state

logger = logging.getLogger(__name__)
router = APIRouter()
P = "moe_infer:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class _EngineCollector:
    """The engine's series, from the snapshot taken for the current scrape."""

    def __init__(self) -> None:
        self.snapshot = None  # (EngineStats, expert load rows, requests in flight)

    def collect(self):
        if self.snapshot is None:
            return
        stats, load, in_flight = self.snapshot
        for name, doc, value in (
            ("num_requests_running", "Sequences in the running batch.", stats.num_running),
            ("num_requests_waiting", "Sequences waiting for admission (new or preempted).", stats.num_waiting),
            ("num_requests_in_flight", "Requests the server has open (an n > 1 request counts once).", in_flight),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", stats.kv_usage),
            ("num_kv_blocks", "KV blocks in the cache.", stats.num_kv_blocks),
            ("num_kv_blocks_used", "KV blocks held by sequences.", stats.num_kv_blocks - stats.num_free_kv_blocks),
            ("prefix_cache_hit_rate", "Prompt blocks found in the prefix cache / looked up, since start.",
             stats.num_prefix_hits / stats.num_prefix_queries if stats.num_prefix_queries else 0.0),
            ("spec_decode_acceptance_rate", "Speculative decoding: accepted / proposed tokens, since start.",
             stats.spec_acceptance_rate),
            ("spec_decode_mean_accepted_length", "Speculative decoding: tokens a verifying sequence-step emits, "
             "on average (1 + accepted / verified), since start.", stats.spec_mean_accepted_length),
        ):
            yield GaugeMetricFamily(P + name, doc, value=value)
        for name, doc, value in (
            ("prefix_cache_queries", "Full prompt blocks looked up in the prefix cache.", stats.num_prefix_queries),
            ("prefix_cache_hits", "Full prompt blocks found in the prefix cache.", stats.num_prefix_hits),
            ("num_preemptions", "Sequences preempted (KV freed, recomputed later).", stats.num_preemptions),
            ("spec_decode_num_draft_tokens", "Speculative decoding: proposed tokens verified.",
             stats.num_spec_proposed_tokens),
            ("spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted.",
             stats.num_spec_accepted_tokens),
            ("spec_decode_num_drafts", "Speculative decoding: sequence-steps that verified proposed tokens.",
             stats.num_spec_verified),
        ):
            yield CounterMetricFamily(P + name, doc, value=value)
        for key, doc in (("routed", "Tokens routed to each expert (one per token and chosen expert)."),
                         ("dropped", "Routed tokens the capacity policy dropped."),
                         ("rerouted", "Routed tokens the capacity policy sent to another expert.")):
            family = CounterMetricFamily(f"{P}expert_{key}_tokens", doc, labels=["layer", "expert"])
            for row in load:
                for expert, value in enumerate(row[key]):
                    family.add_metric([str(row["layer"]), str(expert)], value)
            yield family
        imbalance = GaugeMetricFamily(P + "expert_load_imbalance", "Max / mean tokens routed per expert.",
                                      labels=["layer"])
        for row in load:
            imbalance.add_metric([str(row["layer"])], row["imbalance"])
        yield imbalance


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to the first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Mean time between later tokens of a request.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to finish.", buckets=E2E_BUCKETS, registry=r)
        self.finished = Counter(P + "requests_finished", "Finished completions by finish reason.",
                                ["finished_reason"], registry=r)
        self.rejected_total = Counter(P + "requests_rejected", "Requests refused before the engine.", ["reason"],
                                      registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated by finished requests.", registry=r)
        self.engine = _EngineCollector()
        self.exposed = self._exposed_registry()

    def _exposed_registry(self) -> CollectorRegistry:
        """What a scrape reads: this registry, or with several server processes (moe_infer/server/multi.py)
        prometheus-client's multiprocess collector over every process's files, then the engine's series."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            exposed = CollectorRegistry()
            multiprocess.MultiProcessCollector(exposed)
        else:
            exposed = self.registry
        exposed.register(self.engine)
        return exposed

    def on_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is not None:
            for hist, value in ((self.ttft, m.time_to_first_token), (self.tpot, m.time_per_output_token),
                                (self.e2e, m.e2e_latency)):
                if value is not None:
                    hist.observe(value)
        for c in out.outputs:
            self.finished.labels(finished_reason=c.finish_reason or "unknown").inc()
            self.generation_tokens.inc(len(c.token_ids))
        self.prompt_tokens.inc(len(out.prompt_token_ids))

    def rejected(self, reason: str) -> None:
        self.rejected_total.labels(reason=reason).inc()


@router.get("/metrics", response_class=Response,
            responses={200: {"description": "Prometheus text format",
                             "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    state = get_state(request)
    m: ServerMetrics = state.metrics
    eng = state.engine
    try:
        stats, load = await eng.utility("stats")
        m.engine.snapshot = (stats, load, eng.num_requests_admitted)
    except Exception:  # the engine loop is gone: serve what the server itself counted
        logger.exception("could not read the engine's metrics")
        m.engine.snapshot = None
    return Response(generate_latest(m.exposed), media_type=CONTENT_TYPE_LATEST)
