"""`POST /v1/systemone` over HTTP: auth, 422 in FastAPI's shape, and the shared admission control.

The same handler answers a System One body posted to `/invocations`, so a SageMaker endpoint serves
System One clients too. Busy and not-ready answers are the app's 503 with `Retry-After`, which the SDK
maps to its server-error class and retries.
"""

from __future__ import annotations

import asyncio
import hmac
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from arbiter import jsonio, systemone
from arbiter.engine import Engine
from arbiter.errors import ArbiterError, MalformedRequest
from arbiter.schema import DecisionResult


def served_model_id(engine: Engine) -> str:
    """The model id clients see: ``arbiter/<gguf file name without .gguf>``."""
    name = engine.model_info.file
    return "arbiter/" + (name[: -len(".gguf")] if name.endswith(".gguf") else name)


def unauthorized() -> web.Response:
    return web.json_response(
        {"detail": "missing or invalid API key: send 'Authorization: Bearer <ARBITER_API_KEY>'"},
        status=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


def authorized(request: web.Request, api_key: str | None) -> bool:
    """True when no key is configured, or the bearer token matches it exactly.

    Compared as UTF-8 bytes: ``hmac.compare_digest`` refuses non-ASCII ``str`` (a 500 for any
    client that sent one); aiohttp hands undecodable header bytes over as surrogate escapes.
    """
    if not api_key:
        return True
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    sent = token.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent, api_key.encode("utf-8"))


def invalid(exc: systemone.SystemOneInvalid) -> web.Response:
    return web.json_response({"detail": exc.detail}, status=422)


def parse_body(body: bytes) -> Any:
    try:
        return jsonio.loads(body)
    except MalformedRequest as exc:  # not JSON, not UTF-8, nested too deeply, a 5,000-digit int
        raise systemone.SystemOneInvalid(
            [{"loc": ["body"], "msg": f"JSON decode error: {exc.message}", "type": "json_invalid"}]
        ) from exc


async def answer(raw: Any, engine: Engine, slot_run: Any) -> tuple[dict[str, Any], int, int]:
    """Validate, score every question over the one state, and assemble the response.

    ``slot_run(fn)`` runs blocking work under the app's admission control. Returns the body, the
    question count and the input tokens (for the request log).
    """
    request = await asyncio.to_thread(systemone.parse_request, raw)
    model_id = served_model_id(engine)
    systemone.check_model(request.model, model_id)
    decisions = systemone.to_decisions(request)
    outcomes: list[DecisionResult | ArbiterError] = await slot_run(engine.score, decisions)
    body = systemone.assemble(request, outcomes, model_id)
    return body, len(decisions), body["usage"]["input_tokens"]


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
