"""`POST /invocations`, SageMaker's one route: a decision, decisions, chat messages, a System One
body, or JSON Lines, told apart by the content type and then by the body's keys."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from adapter import budgets, chat, jsonlines, systemone
from adapter.admission import Slot
from adapter.bodies import JSONL_TYPES, json_body
from adapter.openapi import (
    CUSTOM_ATTRIBUTES_HEADER,
    ERRORS,
    JSON,
    SSE_EVENT,
    AnyOf,
    DecisionBatch,
    DecisionBody,
    Error,
    HTTPValidationError,
    JsonLinesRecord,
    Operation,
)
from adapter.state import REQUEST_LOG, STATE, State
from arbiter import jsonio
from arbiter.errors import ArbiterError, InvalidDecision
from arbiter.lines import validate_decision
from arbiter.schema import DecisionRequest
from arbiter.scorer import Outcome
from arbiter.systemone import SystemOneRequest

SHAPES = ("decision", "decisions", "messages")

OPERATION = Operation(
    summary="SageMaker invocation: a decision, a list of decisions, chat messages, a System One "
    "body, or JSON Lines",
    description="Content-Type is required: application/json (a decision, decisions, messages or a "
    "System One body) or application/jsonlines (one decision per line, streamed both ways). Once "
    "a JSON Lines or server-sent-events response has started, a failure is written in-band: an "
    'error record after the lines already answered, or an {"error": ...} event followed by '
    "[DONE].",
    parameters=(CUSTOM_ATTRIBUTES_HEADER,),
    request={
        JSON: AnyOf((DecisionBody, DecisionBatch, chat.ChatCompletionRequest, SystemOneRequest)),
        "application/jsonlines": {
            "type": "string",
            "description": "One DecisionRequest per line (streamed; up to ARBITER_MAX_JSONL_MB)",
        },
    },
    ok="{result} for decision; {results, timing} for decisions; a chat completion "
    "(text/event-stream when stream is true) for messages; the System One answer for a System One "
    "body; one JsonLinesRecord per line for application/jsonlines",
    ok_bodies={
        JSON: {"type": "object"},
        "application/jsonlines": JsonLinesRecord,
        "text/event-stream": SSE_EVENT,
    },
    errors=(400, 401, 408, 413, 415, 422, 500, 503),
    error_notes={
        401: f"{ERRORS[401]} (unless ARBITER_API_KEY_EXEMPT_INVOCATIONS)",
        415: "Content-Type missing or not JSON (JSON Lines on /invocations)",
        422: f"{ERRORS[422]}; a System One body gets the System One API's (FastAPI's) shape",
    },
    error_bodies={422: AnyOf((Error, HTTPValidationError))},
)


async def invocations(request: web.Request) -> web.StreamResponse:
    """Dispatch on the content type, then on the body: decision, decisions or messages."""
    state = request.app[STATE]
    if "Content-Type" in request.headers and request.content_type in JSONL_TYPES:
        request[REQUEST_LOG].kind = "jsonlines"
        return await jsonlines.respond(request, state)
    raw = await json_body(request, state.settings)
    if not isinstance(raw, dict):
        raise InvalidDecision(
            "the body must be a JSON object with one of: decision, decisions, messages",
            code="invalid_type",
        )
    kinds = [key for key in SHAPES if key in raw]
    if not kinds and isinstance(raw.get("questions"), dict):
        request[REQUEST_LOG].kind = "systemone"
        return await systemone.respond(request, state, raw)
    if len(kinds) != 1:
        raise InvalidDecision(
            "the body must have exactly one of: decision, decisions, messages "
            "(or a System One questions map)" + (f" (found {', '.join(kinds)})" if kinds else ""),
            param=None,
            code="unknown_request_shape",
        )
    request[REQUEST_LOG].kind = kinds[0]
    if kinds[0] == "messages":
        return await chat.respond(request, state, raw)
    return await _decide(request, state, raw, single=kinds[0] == "decision")


def validate_many(raw: Any, limit: int) -> list[DecisionRequest]:
    """``{"decisions": [...]}``: 1 to ``limit`` decisions with unique ids."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= limit:
        raise InvalidDecision(
            f"decisions must be an array of 1 to {limit} decisions (ARBITER_MAX_DECISIONS)",
            param="decisions",
            code="invalid_batch_size",
        )
    decisions = [validate_decision(item, f"decisions.{i}") for i, item in enumerate(raw)]
    seen: set[str] = set()
    for i, decision in enumerate(decisions):
        if decision.id in seen:
            raise InvalidDecision(
                f"decisions.{i}.id: duplicate id {decision.id!r}; ids must be unique in a request",
                param=f"decisions.{i}.id",
                code="duplicate_id",
            )
        seen.add(decision.id)
    return decisions


class Decisions:
    """The decisions of one request: ``decision`` is the one-item case of ``decisions``, read,
    named in errors and answered here for both."""

    def __init__(self, raw: dict[str, Any], single: bool, limit: int) -> None:
        self.single = single
        if single:
            self.decisions = [validate_decision(raw["decision"], "decision")]
        else:
            self.decisions = validate_many(raw["decisions"], limit)

    def where(self, index: int) -> str:
        """The field an item's error is named under (``decision.options``, ``decisions.2.id``)."""
        return "decision" if self.single else f"decisions.{index}"

    def body(self, outcomes: list[Outcome], timing: dict[str, Any]) -> bytes:
        """The answer once one item at least has a result (see :func:`_decide`)."""
        if self.single:
            (outcome,) = outcomes
            if isinstance(outcome, ArbiterError):  # :func:`_decide` raised it already
                raise outcome.with_param_prefix(self.where(0))
            return jsonio.dumps({"result": outcome.model_dump()})
        results = [
            {"id": d.id, "error": o.with_param_prefix(self.where(i)).to_dict()}
            if isinstance(o, ArbiterError)
            else o.model_dump()
            for i, (d, o) in enumerate(zip(self.decisions, outcomes, strict=True))
        ]
        return jsonio.dumps({"results": results, "timing": timing})


async def _decide(
    request: web.Request, state: State, raw: dict[str, Any], single: bool
) -> web.Response:
    """``decision`` or ``decisions``: screened before admission, scored in one engine call under
    one slot, each outcome counted once. If every item fails, the request fails with the first
    item's error (its field named); otherwise every item has its result or its error."""
    arrived = time.perf_counter()
    items = await asyncio.to_thread(Decisions, raw, single, state.settings.max_decisions)
    decisions = items.decisions
    engine = state.holder.require()
    request[REQUEST_LOG].decisions = len(decisions)
    refused = budgets.screen(state.settings, engine, decisions)  # before it takes a slot
    if refused[0] is not None and all(error is not None for error in refused):
        raise refused[0].with_param_prefix(items.where(0))

    def work(slot: Slot) -> tuple[list[Outcome], float]:
        started = time.perf_counter()
        outcomes = engine.score(decisions, budgets.limits(state.settings, engine, slot))
        for outcome in outcomes:
            state.metrics.observe_decision(outcome)
        return outcomes, time.perf_counter() - started

    async with state.admission.slot() as slot:
        admitted = time.perf_counter()
        outcomes, engine_s = await slot.run(work, slot)
    failed = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, ArbiterError)]
    if len(failed) == len(outcomes):
        index, first = failed[0]
        raise first.with_param_prefix(items.where(index))
    request[REQUEST_LOG].tokens = sum(
        o.prompt.input_tokens for o in outcomes if not isinstance(o, ArbiterError)
    )
    timing = {
        "decisions": len(decisions),
        "failed": len(failed),
        "queue_s": admitted - arrived,
        "engine_s": engine_s,
        "total_s": time.perf_counter() - arrived,
    }
    body = await asyncio.to_thread(items.body, outcomes, timing)
    return web.Response(body=body, content_type="application/json")
