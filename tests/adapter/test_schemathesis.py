"""The served OpenAPI document, fuzzed route by route with schemathesis against the real engine.

For every operation, requests generated from the document (valid ones, and ones that break it on
purpose) must get: no 5xx, a status the document lists, the documented content type, a body that
matches the documented schema (every 4xx in the error model), and the server healthy afterwards.
Generation is capped at 2 tokens so chat stays quick; everything else (rendering, tokenizing,
scoring, sampling parameters) is the real thing. ``make fuzz`` runs many more examples.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from adapter.app import create_app
from adapter.openapi import PATH as OPENAPI_PATH
from arbiter.engine import Engine, Generation
from arbiter.settings import EngineSettings, ServerSettings
from tests.live_server import serve
from tests.strategies import examples
from tests.threads import TEST_THREADS

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
_DOC = json.loads(OPENAPI_PATH.read_text())
OPERATIONS = [
    (method.upper(), path, bool(op.get("requestBody") or op.get("parameters")))
    for path, ops in _DOC["paths"].items()
    for method, op in ops.items()
]


class QuickEngine(Engine):
    """The real engine with chat completions capped at 2 tokens."""

    def generate(self, tokens: Any, *, max_tokens: int, **kw: Any) -> Generation:
        return super().generate(tokens, max_tokens=min(max_tokens, 2), **kw)


@pytest.fixture(scope="module")
def server(default_gguf: Path) -> Iterator[str]:
    engine = QuickEngine(EngineSettings(model=default_gguf, n_ctx=512, n_threads=TEST_THREADS))
    # Up to 8 decisions a request (more is a documented 422) keeps generated batches quick.
    settings_ = ServerSettings(max_in_flight=1, max_queue=8, queue_timeout_s=300, max_decisions=8)
    try:
        with serve(create_app(settings_, lambda: engine, close_engine=False)) as base:
            yield base
    finally:
        engine.close()


@pytest.fixture(scope="module")
def schema(server: str) -> Any:
    return schemathesis.openapi.from_url(f"{server}/openapi.json")  # the document as served


def _alive(base: str) -> bool:
    with urllib.request.urlopen(f"{base}/ping", timeout=30) as response:
        return bool(response.status == 200)


@pytest.mark.parametrize(
    ("method", "path", "mode"),
    [
        (method, path, mode)
        for method, path, has_input in OPERATIONS
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        if has_input or mode is GenerationMode.POSITIVE
    ],
    ids=lambda v: v.name.lower() if isinstance(v, GenerationMode) else str(v),
)
def test_generated_requests_get_documented_answers_and_no_5xx(
    schema: Any, server: str, method: str, path: str, mode: GenerationMode
) -> None:
    operation = schema[path][method]
    statuses: list[int] = []

    @settings(
        max_examples=examples(12),
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call(base_url=server, timeout=300)
        statuses.append(response.status_code)
        case.validate_response(response, checks=CHECKS)

    run()
    assert statuses and max(statuses) < 500
    assert _alive(server)
