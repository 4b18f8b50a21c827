"""Typed errors. Each carries its HTTP status, type and code; the server maps them in one place
(``adapter.middleware``), the worker and ``arbiter decide`` write them as error records."""

from __future__ import annotations

import threading
from typing import Any, ClassVar


class ArbiterError(Exception):
    """Base class: a failure with a stable code, an optional offending field, and an HTTP status."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "api_error"
    code: ClassVar[str] = "internal_error"
    retryable: ClassVar[bool] = False
    # An API that speaks FastAPI's error shape (System One) answers ``{"detail": detail}``
    # instead of ``{"error": to_dict()}``.
    detail: list[dict[str, Any]] | str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code  # type: ignore[misc]

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.type, "code": self.code, "message": self.message}
        body["param"] = self.param
        if self.retryable:
            body["retryable"] = True
        return body

    def with_param_prefix(self, prefix: str) -> ArbiterError:
        """Re-home the error inside a container field, e.g. ``decisions[3].`` + ``options``."""
        self.param = f"{prefix}.{self.param}" if self.param else prefix
        return self


class MalformedRequest(ArbiterError):
    """The body cannot be read at all (not JSON, not UTF-8)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_json"


class InvalidDecision(ArbiterError):
    """Valid JSON, but a decision in it breaks the schema or a limit (``param`` names the field)."""

    status = 422
    type = "invalid_request_error"
    code = "invalid_decision"


class TooManyOptions(InvalidDecision):
    code = "too_many_options"


class ContextLengthExceeded(InvalidDecision):
    code = "context_length_exceeded"


class TimeBudgetExceeded(InvalidDecision):
    """The request's work would take, or took, longer than ``ARBITER_MAX_REQUEST_SECONDS``."""

    code = "request_time_budget_exceeded"


class UnsafeText(InvalidDecision):
    code = "control_token_in_text"


class ModelLoadError(ArbiterError):
    """The model cannot be served: missing, unreadable, checksum mismatch, unusable vocabulary."""

    code = "model_load_failed"


class ManifestMismatch(ModelLoadError):
    code = "manifest_sha256_mismatch"


class LabelVocabularyError(ModelLoadError):
    code = "label_tokens_unusable"


class TemplateRefused(ModelLoadError):
    """The model's chat template cannot render a decision prompt."""

    code = "chat_template_unusable"


class ReadCheckRefused(ModelLoadError):
    """The start-up probes put too little probability on the labels where they are read."""

    code = "read_check_failed"


class EngineFailure(ArbiterError):
    """llama.cpp reported an error while computing (not the caller's fault)."""

    code = "engine_failure"


class PayloadTooLarge(ArbiterError):
    """The body (or one JSON Lines record) is over the configured limit."""

    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class TokenBudgetExceeded(PayloadTooLarge):
    """The request's prompt tokens are over ``ARBITER_MAX_REQUEST_TOKENS`` (refused before the
    engine decodes any of them)."""

    code = "request_token_budget_exceeded"


class RequestCancelled(ArbiterError):
    """The client went away: its work stopped at the next decision or decode boundary. Nobody
    reads this answer; it ends the engine call (one decision's error would not)."""

    status = 499
    type = "client_closed_request"
    code = "request_cancelled"


class RequestTimeout(ArbiterError):
    """The client stopped sending its body (``ARBITER_BODY_READ_TIMEOUT_S``)."""

    status = 408
    type = "invalid_request_error"
    code = "body_read_timeout"


class Unauthorized(ArbiterError):
    """``ARBITER_API_KEY`` is set and the request's bearer token is missing or wrong."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class UnsupportedMediaType(ArbiterError):
    """A ``Content-Type`` the route does not read."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class NotFound(ArbiterError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(ArbiterError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class Unavailable(ArbiterError):
    """503: try again later. ``retry_after`` (seconds) becomes the ``Retry-After`` header."""

    status = 503
    type = "overloaded_error"
    code = "unavailable"
    retryable = True

    def __init__(self, message: str, *, retry_after: int = 1, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after = retry_after


class ServerBusy(Unavailable):
    """Every in-flight slot is busy and the wait queue is full (or the wait timed out)."""

    code = "server_busy"


class ModelNotReady(Unavailable):
    """The model is still loading."""

    code = "model_not_ready"


class LoadCancelled(Unavailable):
    """The model's load was stopped part-way: its server is stopping (a stop signal while it
    loaded), so the load is abandoned rather than awaited."""

    code = "model_load_cancelled"

    @classmethod
    def check(cls, cancel: threading.Event | None) -> None:
        """Raised here once ``cancel`` is set: the load's checkpoints call it."""
        if cancel is not None and cancel.is_set():
            raise cls("the server is stopping: the model's load was cancelled")


class UnsupportedSetting(ModelLoadError):
    """A configuration the container refuses at start-up (e.g. a model hub download)."""

    code = "unsupported_setting"


class UnsupportedParameter(InvalidDecision):
    """A request parameter Arbiter does not honour (``param`` names it): refused, never ignored."""

    code = "unsupported_parameter"


class InvalidGrammar(InvalidDecision):
    """A ``grammar``, ``json_schema`` or ``response_format`` that cannot constrain generation."""

    code = "invalid_grammar"
