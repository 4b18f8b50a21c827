"""Batch Transform's `MaxPayloadInMB`, sized so that one mini-batch fits the invocation timeout.

Batch Transform posts up to ``MaxPayloadInMB`` of JSON Lines per invocation and gives the container
``ModelClientConfig.InvocationsTimeoutInSeconds`` (600 s by default, at most 3,600 s) to answer;
a slower answer is retried, then the job fails. At a few decisions per second on a CPU a 6 MB
mini-batch (thousands of lines) takes far longer than that. So the container measures what it
scores here, once, on probe lines of a typical size, and advertises the payload that takes at most
half the timeout (``ARBITER_BATCH_INVOCATION_TIMEOUT_S``); ``ARBITER_BATCH_MAX_PAYLOAD_MB`` overrides it.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Literal

from aiohttp import web
from pydantic import BaseModel

from adapter.openapi import JSON, Operation
from adapter.state import STATE, State, Throughput
from arbiter.errors import MalformedRequest
from arbiter.lines import score_lines
from arbiter.logging import get_logger
from arbiter.scorer import Scorer
from arbiter.settings import MB

log = get_logger("arbiter.http")
MIN_PAYLOAD_MB = 1  # Batch Transform's smallest useful value (0 means "unlimited")
MAX_PAYLOAD_MB = 100  # its largest
BUDGET_SHARE = 0.5  # of the timeout: room for slower lines and a busier machine

# A support ticket of about 1 kB: records much shorter than this cost more per byte (the fixed part
# of each prompt weighs more), so payloads of tiny records should be sized by hand.
_TICKET = (
    "Customer {n} writes: since the update this morning none of our users can sign in with single "
    "sign-on. The identity provider shows the assertions as sent, but the application answers "
    "with an error page after the redirect. We have 340 seats on the enterprise plan and the "
    "outage blocks our whole support team. We already cleared caches, tried two browsers and "
    "rotated the signing certificate without any change. Our administrator is available all day "
    "for a call. Please treat this as urgent; our contract promises a response within one hour "
    "for incidents of this severity, and the invoice for this month is due on Friday, which our "
    "finance team will not approve while the service is down."
)


def probe_lines(count: int = 2, salt: str = "") -> list[bytes]:
    """Typical records, each over its own state (``salt`` keeps them out of the prefix cache)."""
    return [
        json.dumps(
            {
                "id": f"probe-{n}",
                "state": {"ticket": f"T-{salt}{n}", "text": _TICKET.format(n=n)},
                "question": "Which queue should handle this ticket?",
                "options": [
                    {"id": "identity", "description": "Identity and single sign-on"},
                    {"id": "billing", "description": "Billing and invoices"},
                    {"id": "general", "description": "General support"},
                ],
            }
        ).encode()
        for n in range(count)
    ]


def measure(engine: Scorer) -> Throughput:
    """Score the probe lines one engine call each, as the JSON Lines path would."""
    lines = probe_lines(salt=uuid.uuid4().hex[:8])  # never a cached prefix: a cold measure
    started = time.perf_counter()
    for number, line in enumerate(lines, 1):
        score_lines(engine, [(number, line)])
    seconds = max(time.perf_counter() - started, 1e-9)
    size = sum(len(line) + 1 for line in lines)
    return Throughput(seconds_per_mb=seconds * MB / size, lines_per_s=len(lines) / seconds)


def payload_mb(throughput: Throughput, timeout_s: float) -> int:
    """The largest whole number of MB that takes at most ``BUDGET_SHARE`` of ``timeout_s``."""
    fits = math.floor(timeout_s * BUDGET_SHARE / throughput.seconds_per_mb)
    return max(MIN_PAYLOAD_MB, min(MAX_PAYLOAD_MB, fits))


class ExecutionParameters(BaseModel):
    """What Batch Transform reads from `GET /execution-parameters` before it starts posting."""

    MaxConcurrentTransforms: int
    BatchStrategy: Literal["MULTI_RECORD"]
    MaxPayloadInMB: int


TIMEOUT_PARAMETER = "InvocationsTimeoutInSeconds"
OPERATION = Operation(
    summary="Batch Transform hints",
    ok="MaxConcurrentTransforms (ARBITER_MAX_IN_FLIGHT), BatchStrategy MULTI_RECORD, and "
    "MaxPayloadInMB: ARBITER_BATCH_MAX_PAYLOAD_MB, or sized from this machine's measured speed so "
    "one mini-batch takes at most half of ARBITER_BATCH_INVOCATION_TIMEOUT_S (or of the "
    "InvocationsTimeoutInSeconds asked for)",
    ok_bodies={JSON: ExecutionParameters},
    errors=(400, 500, 503),
    error_notes={400: "InvocationsTimeoutInSeconds is not a whole number of 1 to 3600"},
    parameters=(
        {
            "name": TIMEOUT_PARAMETER,
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": 3600},
            "description": "size MaxPayloadInMB for this transform job's timeout rather than the "
            "container's ARBITER_BATCH_INVOCATION_TIMEOUT_S (SageMaker sends none: there the "
            "job's Environment sets the variable; `arbiter transform` sends its job's)",
        },
    ),
)


def _asked_timeout(request: web.Request) -> float | None:
    raw = request.query.get(TIMEOUT_PARAMETER)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= 3600):
        raise MalformedRequest(
            f"{TIMEOUT_PARAMETER} is a whole number of seconds, 1 to 3600 (got {raw[:20]!r})",
            param=TIMEOUT_PARAMETER,
            code="invalid_parameter",
        )
    return float(raw)


async def execution_parameters(request: web.Request) -> web.Response:
    """`GET /execution-parameters`, the speed measured once when no MaxPayloadInMB is configured."""
    state = request.app[STATE]
    s = state.settings
    timeout_s = _asked_timeout(request)
    params = ExecutionParameters(
        MaxConcurrentTransforms=s.max_in_flight,
        BatchStrategy="MULTI_RECORD",
        MaxPayloadInMB=s.batch_max_payload_mb or await batch_payload(state, timeout_s),
    )
    return web.json_response(params.model_dump())


async def batch_payload(state: State, timeout_s: float | None = None) -> int:
    """MaxPayloadInMB for ``timeout_s`` (default: ARBITER_BATCH_INVOCATION_TIMEOUT_S) from this
    machine's speed, measured once under a compute slot."""
    async with state.sizing:
        if state.batch_speed is None:
            engine = state.holder.require()
            async with state.admission.slot() as slot:
                state.batch_speed = await slot.run(measure, engine)
        speed = state.batch_speed
    timeout_s = timeout_s or state.settings.batch_invocation_timeout_s
    mb = payload_mb(speed, timeout_s)
    if state.batch_sized.get(timeout_s) is None:
        state.batch_sized[timeout_s] = mb
        fits = mb * speed.seconds_per_mb <= timeout_s * BUDGET_SHARE
        (log.info if fits else log.warning)(
            "batch_payload_sized",
            max_payload_mb=mb,
            seconds_per_mb=round(speed.seconds_per_mb, 1),
            lines_per_s=round(speed.lines_per_s, 2),
            invocation_timeout_s=timeout_s,
            fits=fits,
            advice=None
            if fits
            else "raise ModelClientConfig.InvocationsTimeoutInSeconds (at most 3600) and "
            "ARBITER_BATCH_INVOCATION_TIMEOUT_S to match",
        )
    return mb
