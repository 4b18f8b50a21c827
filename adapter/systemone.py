"""TypeSafe System One over HTTP (`POST /v1/systemone`, and a System One body on `/invocations`).

The mapping onto decisions is the core's (``arbiter.systemone``); here the body is read, every question
is scored over the one state under the app's admission control, and the answer is written. Its
errors are raised like any other: the middleware answers a ``SystemOneInvalid`` with 422 and
FastAPI's ``{"detail": [...]}``. Busy and not-ready answers are the app's 503 with `Retry-After`, which
the SDK maps to its server-error class and retries.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from pydantic import BaseModel, Field

from adapter import budgets
from adapter.bodies import read_json
from adapter.openapi import JSON, DetailMessage, HTTPValidationError, Operation
from adapter.state import REQUEST_LOG, STATE, State
from arbiter import jsonio, systemone
from arbiter.engine import Engine
from arbiter.errors import MalformedRequest
from arbiter.scorer import Outcome


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class SystemOneResponse(BaseModel):
    model: str
    answers: dict[str, dict[str, Any]] = Field(
        description="noul: {type, noul}; choice: {type, choice, probabilities, confidence}; "
        "score: {type, score, legend, probabilities, confidence}"
    )
    usage: Usage


OPERATION = Operation(
    summary="TypeSafe System One: questions (noul, choice, score) about one state, answered with "
    "probabilities",
    request={JSON: systemone.SystemOneRequest},
    ok="Answers keyed by question id",
    ok_bodies={JSON: SystemOneResponse},
    errors=(401, 408, 413, 415, 422, 500, 503),
    error_notes={
        422: "Validation failure naming the field, or a body that is not JSON (FastAPI shape)"
    },
    error_bodies={401: DetailMessage, 422: HTTPValidationError},
)


def served_model_id(engine: Engine) -> str:
    """The model id clients see: ``arbiter/<gguf file name without .gguf>``."""
    name = engine.model_info.file
    return "arbiter/" + (name[: -len(".gguf")] if name.endswith(".gguf") else name)


def parse_body(body: bytes) -> Any:
    """JSON that cannot be read is the System One API's 422 (``json_invalid``), not a 400."""
    try:
        return jsonio.loads(body)
    except MalformedRequest as exc:  # not JSON, not UTF-8, nested too deeply, a 5,000-digit int
        raise systemone.SystemOneInvalid(
            [{"loc": ["body"], "msg": f"JSON decode error: {exc.message}", "type": "json_invalid"}]
        ) from exc


async def systemone_route(request: web.Request) -> web.Response:
    """`POST /v1/systemone`: the TypeSafe System One API."""
    state = request.app[STATE]
    request[REQUEST_LOG].kind = "systemone"
    body = await read_json(request, state.settings)
    raw = await asyncio.to_thread(parse_body, body)
    return await respond(request, state, raw)


async def respond(request: web.Request, state: State, raw: Any) -> web.Response:
    """Validate, score every question over the one state, and answer."""
    engine = state.holder.require()
    parsed = await asyncio.to_thread(systemone.parse_request, raw)
    model_id = served_model_id(engine)
    systemone.check_model(parsed.model, model_id)
    decisions = systemone.with_budget(systemone.to_decisions(parsed), *budget_headers(request))
    systemone.refuse(parsed, budgets.screen(state.settings, engine, decisions))  # before a slot
    async with state.admission.slot() as slot:
        budget = budgets.limits(state.settings, engine, slot)
        outcomes: list[Outcome] = await slot.run(engine.score, decisions, budget)
    body = systemone.assemble(parsed, outcomes, model_id)
    request[REQUEST_LOG].decisions = len(decisions)
    request[REQUEST_LOG].tokens = body["usage"]["input_tokens"]
    return web.json_response(body)


BUDGET_HEADERS = (("X-Arbiter-Max-Error", 0.0, 1.0), ("X-Arbiter-Min-Confidence", 0.0, 1.0))


def budget_headers(request: web.Request) -> tuple[float | None, float | None]:
    """An error budget (0 < e < 1) and a minimum confidence (0 to 1) from the request's headers;
    a bad value is System One's 422 naming the header."""
    values: list[float | None] = []
    for name, low, high in BUDGET_HEADERS:
        text = request.headers.get(name)
        if text is None:
            values.append(None)
            continue
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        exclusive = name == "X-Arbiter-Max-Error"
        inside = low < value < high if exclusive else low <= value <= high
        if not inside:
            bound = "between 0 and 1, exclusive" if exclusive else "from 0 to 1"
            raise systemone.SystemOneInvalid(
                [
                    {
                        "loc": ["header", name.lower()],
                        "msg": f"{name} must be a number {bound} (got {text!r})",
                        "type": "value_error",
                    }
                ]
            )
        values.append(value)
    return values[0], values[1]


def models_listing(engine: Engine) -> list[dict[str, str]]:
    """The served model and its aliases, in the shape the TypeSafe SDK's `models.list()` reads."""
    model_id = served_model_id(engine)
    info = engine.model_info
    description = (
        f"{info.description} ({info.quantization}, {info.file}, sha256 {info.sha256[:12]}) "
        "served by Arbiter with llama.cpp"
    )
    # GGUF metadata carries no release date; the model file's own date is the honest stand-in.
    release = datetime.fromtimestamp(engine.resolved.path.stat().st_mtime, UTC).date().isoformat()
    return [
        {"name": name, "description": description, "release_date": release}
        for name in (model_id, *systemone.ALIASES)
    ]
