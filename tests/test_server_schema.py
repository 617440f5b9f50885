"""schemathesis against the live server's own OpenAPI schema: valid and invalid bodies for every operation,
and no 5xx, responses in their documented status codes, content types and schemas. Bounded: a
48-token context, a fixed number of examples per operation (about a minute in all on 2 CPU cores)."""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (content_type_conformance, not_a_server_error,  # noqa: E402
                                 response_schema_conformance, status_code_conformance)
from server_fixtures import MODEL, live_server  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
STATUSES = {}  # (method path, status) -> count


@pytest.fixture(scope="module")
def live():
    with live_server(serve=dict(max_n=2, max_logprobs=5, max_queued_requests=8), max_model_len=48,
                     num_kv_blocks=32, max_num_seqs=4) as srv:
        yield srv


@pytest.mark.timeout(300)
def test_no_server_errors(live):
    """Every operation, positive and negative bodies. Driven through schemathesis' Hypothesis strategies
    (`APIOperation.as_strategy`) rather than its pytest plugin, whose lazy fixture path reads pytest's
    private node attributes (it broke on pytest 9.2)."""
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions"}
    for operation in operations:
        takes_input = len(operation.body) > 0 or any(True for _ in operation.iter_parameters())
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if takes_input else (GenerationMode.POSITIVE,)
        for mode in modes:  # an operation with no body or parameters has no invalid request to make
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=15, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def call(case):
                if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
                    case.body["model"] = MODEL  # a made-up name is a 404 before the engine; name the served one
                response = case.call_and_validate(base_url=live.url, checks=CHECKS, timeout=60)
                key = (f"{case.method} {case.path}", response.status_code)
                STATUSES[key] = STATUSES.get(key, 0) + 1

            call()


@pytest.mark.timeout(60)
def test_the_examples_reached_the_engine(live):
    """The fuzzing above is not all 4xx: some requests of each endpoint generated (and some were refused)."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert STATUSES.get((f"POST {path}", 200), 0) >= 1, STATUSES
        assert STATUSES.get((f"POST {path}", 400), 0) >= 3, STATUSES
    live.wait_idle()
