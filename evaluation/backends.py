"""Where an evaluated decision is answered: the in-process engine, or a running endpoint.

Either way a backend returns ``(result, error)`` as JSON-like dicts, so the records of an eval do not
depend on where it ran; a failure (an error answer, a timeout, an unreadable response) is an error.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Protocol

from arbiter.engine import Engine
from arbiter.errors import ArbiterError
from arbiter.schema import DecisionRequest

Outcome = tuple[dict[str, Any] | None, dict[str, Any] | None]  # (result, error)


class Backend(Protocol):
    name: str

    def decide(self, request: DecisionRequest) -> Outcome: ...

    def close(self) -> None: ...


class EngineBackend:
    """The in-process engine (``ARBITER_*`` settings, or ``--model``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = f"in-process ({engine.model_info.file})"

    def decide(self, request: DecisionRequest) -> Outcome:
        try:
            outcome = self.engine.score([request])[0]
        except ArbiterError as exc:
            return None, exc.to_dict()
        if isinstance(outcome, ArbiterError):
            return None, outcome.to_dict()
        return outcome.model_dump(mode="json"), None

    def close(self) -> None:
        self.engine.close()


class HttpBackend:
    """A running Arbiter endpoint: one ``POST /invocations`` per decision."""

    def __init__(self, url: str, timeout: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.name = self.url

    def decide(self, request: DecisionRequest) -> Outcome:
        body = json.dumps({"decision": request.model_dump(mode="json", exclude_none=True)})
        req = urllib.request.Request(
            f"{self.url}/invocations",
            data=body.encode(),
            headers={"Content-Type": "application/json", "Accept": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as response:
                raw = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return None, _http_error(exc)
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            return None, {"type": "connection_error", "code": "unreachable", "message": str(exc)}
        except json.JSONDecodeError as exc:
            return None, {"type": "api_error", "code": "bad_response", "message": str(exc)}
        result = raw.get("result") if isinstance(raw, dict) else None
        if not isinstance(result, dict) or "probabilities" not in result:
            return None, {
                "type": "api_error",
                "code": "bad_response",
                "message": 'the response has no "result" with probabilities',
            }
        return result, None

    def close(self) -> None:
        return None


def _http_error(exc: urllib.error.HTTPError) -> dict[str, Any]:
    try:
        raw = json.loads(exc.read())
    except (json.JSONDecodeError, OSError, ValueError):
        raw = None
    error = raw.get("error") if isinstance(raw, dict) else None
    if isinstance(error, dict):
        return {**error, "status": exc.code}
    return {
        "type": "api_error",
        "code": f"http_{exc.code}",
        "message": str(exc),
        "status": exc.code,
    }
