"""The OpenAPI document, generated from the route table and the pydantic wire models.

Each route family declares its ``Operation`` beside its handler (``adapter.app.ROUTES`` pairs them);
request and response bodies are the pydantic models that validate them, so their schemas are the
models' own. ``arbiter openapi`` rewrites ``adapter/openapi.json``, the document the app serves; a
test regenerates it and compares, so the committed document cannot drift from the code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from arbiter.schema import DecisionRequest, DecisionResult
from arbiter.settings import ServerSettings

PATH = Path(__file__).with_name("openapi.json")
TITLE = "Arbiter"
DESCRIPTION = (
    "Decision models served with llama.cpp: a SageMaker inference container (real-time, async "
    "and batch transform), the TypeSafe System One API and an OpenAI-style chat completions "
    "endpoint."
)
REF = "#/components/schemas/{model}"


# -- wire envelopes: the shapes around the core's models -------------------------------------------


class ErrorInfo(BaseModel):
    """``ArbiterError.to_dict()``: what failed, its stable code, and the field at fault."""

    type: str
    code: str
    message: str
    param: str | None
    retryable: bool = Field(default=False, description="Present (true) on a 503: retry later.")


class Error(BaseModel):
    """Every error answer but the System One API's own (FastAPI's shape, below)."""

    error: ErrorInfo


class DecisionBody(BaseModel):
    decision: DecisionRequest


class DecisionBatch(BaseModel):
    decisions: list[DecisionRequest] = Field(
        min_length=1, max_length=ServerSettings.model_fields["max_decisions"].default
    )


class JsonLinesRecord(BaseModel):
    """One output line per input line: the result or the error of that line's decision."""

    line: int
    id: Any = None
    result: DecisionResult | None = None
    error: ErrorInfo | None = None


class ValidationDetail(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class HTTPValidationError(BaseModel):
    """FastAPI's 422, as the System One API answers it."""

    detail: list[ValidationDetail]


class DetailMessage(BaseModel):
    """FastAPI's shape for other errors (the System One API's 401)."""

    detail: str


SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "description": 'One server-sent event: data is a chat.completion.chunk as JSON, an {"error": '
    "...} object, or [DONE]",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}


# -- operations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnyOf:
    """A body that is any one of these schemas."""

    schemas: tuple[Schema, ...]


Schema = type[BaseModel] | dict[str, Any] | AnyOf

ERRORS = {
    400: "Malformed JSON",
    401: "ARBITER_API_KEY is set and the bearer token is missing or wrong (WWW-Authenticate: "
    "Bearer)",
    408: "The client stopped sending its body for ARBITER_BODY_READ_TIMEOUT_S",
    413: "Body too large",
    415: "Content-Type missing or not JSON",
    422: "Valid JSON that breaks the schema or a limit (param names the field)",
    500: "Internal fault",
    503: "Busy (Retry-After) or model not ready",
}
JSON = "application/json"
CUSTOM_ATTRIBUTES_HEADER = {
    "name": "X-Amzn-SageMaker-Custom-Attributes",
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
    "description": "Echoed on the response; request_id=... (or a single token) becomes the log "
    "request id",
}


@dataclass(frozen=True)
class Operation:
    """What the document says about one route: its bodies by content type, and the statuses it
    answers with (``Error`` bodies unless ``error_bodies`` names another)."""

    summary: str
    ok: str
    ok_bodies: Mapping[str, Schema] = field(default_factory=dict)
    request: Mapping[str, Schema] = field(default_factory=dict)
    errors: tuple[int, ...] = (500, 503)
    error_notes: Mapping[int, str] = field(default_factory=dict)
    error_bodies: Mapping[int, Schema] = field(default_factory=dict)
    description: str | None = None
    parameters: tuple[dict[str, Any], ...] = ()


class Route(Protocol):
    """What the document reads from a route of the table (``adapter.app.Route``)."""

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def operation(self) -> Operation: ...


def _models(schema: Schema) -> Iterable[type[BaseModel]]:
    if isinstance(schema, AnyOf):
        for inner in schema.schemas:
            yield from _models(inner)
    elif isinstance(schema, type):
        yield schema


def _ref(schema: Schema) -> dict[str, Any]:
    if isinstance(schema, AnyOf):
        return {"anyOf": [_ref(inner) for inner in schema.schemas]}
    if isinstance(schema, type):
        return {"$ref": REF.format(model=schema.__name__)}
    return schema


def _content(bodies: Mapping[str, Schema]) -> dict[str, Any]:
    return {ctype: {"schema": _ref(schema)} for ctype, schema in bodies.items()}


def _operation(op: Operation) -> dict[str, Any]:
    out: dict[str, Any] = {"summary": op.summary}
    if op.description:
        out["description"] = op.description
    if op.parameters:
        out["parameters"] = list(op.parameters)
    if op.request:
        out["requestBody"] = {"required": True, "content": _content(op.request)}
    ok: dict[str, Any] = {"description": op.ok}
    if op.ok_bodies:
        ok["content"] = _content(op.ok_bodies)
    responses: dict[str, Any] = {"200": ok}
    for status in op.errors:
        body = op.error_bodies.get(status, Error)
        responses[str(status)] = {
            "description": op.error_notes.get(status, ERRORS[status]),
            "content": _content({JSON: body}),
        }
    out["responses"] = responses
    return out


def _components(routes: Iterable[Route]) -> dict[str, Any]:
    """Every model a route names, with the models they use, as the models' own JSON schemas."""
    modes: dict[type[BaseModel], JsonSchemaMode] = {}
    for route in routes:
        op = route.operation
        for schema in op.request.values():
            for model in _models(schema):
                modes.setdefault(model, "validation")
        for schema in (*op.ok_bodies.values(), *op.error_bodies.values(), Error):
            for model in _models(schema):
                modes.setdefault(model, "serialization")
    _, schemas = models_json_schema(list(modes.items()), ref_template=REF)
    return dict(schemas.get("$defs", {}))


def _version() -> str:
    try:
        return metadata.version("arbiter")
    except metadata.PackageNotFoundError:  # pragma: no cover - a bare checkout
        return "0+unknown"


def document(routes: Iterable[Route]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes``."""
    routes = list(routes)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route.operation)
    return {
        "openapi": "3.1.0",
        "info": {"title": TITLE, "version": _version(), "description": DESCRIPTION},
        "paths": paths,
        "components": {"schemas": _components(routes)},
    }


def render(routes: Iterable[Route]) -> str:
    return json.dumps(document(routes), indent=2, ensure_ascii=False) + "\n"


def write(routes: Iterable[Route], *, check: bool = False) -> bool:
    """Rewrite ``adapter/openapi.json`` from ``routes``; with ``check``, only say whether it is
    up to date. True when the file is (now) the generated document."""
    text = render(routes)
    if check:
        return PATH.exists() and PATH.read_text(encoding="utf-8") == text
    PATH.write_text(text, encoding="utf-8")
    return True
