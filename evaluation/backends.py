"""Where an evaluated decision is answered: the in-process engine, or a running endpoint.

Either way a backend returns ``(result, error)`` as JSON-like dicts, so the records of an eval do not
depend on where it ran; a failure (an error answer, a timeout, an unreadable response) is an error.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, Protocol

from arbiter.engine import Engine
from arbiter.errors import ArbiterError
from arbiter.schema import DecisionRequest

ResultOrError = tuple[dict[str, Any] | None, dict[str, Any] | None]  # (result, error)


class Backend(Protocol):
    name: str

    def decide(self, request: DecisionRequest) -> ResultOrError: ...

    def decide_many(self, requests: Sequence[DecisionRequest]) -> list[ResultOrError]:
        """Decisions sent together (one request: a shared state is prefilled once)."""
        ...

    def calibration(self) -> dict[str, Any] | None:
        """The served calibration (``arbiter.engine.calibration.describe``), if known."""
        ...

    def close(self) -> None: ...


class EngineBackend:
    """The in-process engine (``ARBITER_*`` settings, or ``--model``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = f"in-process ({engine.model_info.file})"

    def decide(self, request: DecisionRequest) -> ResultOrError:
        try:
            outcome = self.engine.score([request])[0]
        except ArbiterError as exc:
            return None, exc.to_dict()
        if isinstance(outcome, ArbiterError):
            return None, outcome.to_dict()
        return outcome.model_dump(mode="json"), None

    def decide_many(self, requests: Sequence[DecisionRequest]) -> list[ResultOrError]:
        try:
            outcomes = self.engine.score(list(requests))
        except ArbiterError as exc:
            return [(None, exc.to_dict())] * len(requests)
        return [
            (None, o.to_dict())
            if isinstance(o, ArbiterError)
            else (o.model_dump(mode="json"), None)
            for o in outcomes
        ]

    def calibration(self) -> dict[str, Any] | None:
        return self.engine.calibration_info()

    def close(self) -> None:
        self.engine.close()


class HttpBackend:
    """A running Arbiter endpoint: one ``POST /invocations`` per decision."""

    def __init__(self, url: str, timeout: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.name = self.url

    def _post(self, body: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
        req = urllib.request.Request(
            f"{self.url}/invocations",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Accept": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as response:
                return json.loads(response.read()), None
        except urllib.error.HTTPError as exc:
            return None, _http_error(exc)
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            return None, {"type": "connection_error", "code": "unreachable", "message": str(exc)}
        except json.JSONDecodeError as exc:
            return None, {"type": "api_error", "code": "bad_response", "message": str(exc)}

    def decide(self, request: DecisionRequest) -> ResultOrError:
        raw, error = self._post({"decision": request.model_dump(mode="json", exclude_none=True)})
        if error is not None:
            return None, error
        result = raw.get("result") if isinstance(raw, dict) else None
        return _checked(result)

    def decide_many(self, requests: Sequence[DecisionRequest]) -> list[ResultOrError]:
        decisions = [r.model_dump(mode="json", exclude_none=True) for r in requests]
        raw, error = self._post({"decisions": decisions})
        if error is not None:
            return [(None, error)] * len(requests)
        results = raw.get("results") if isinstance(raw, dict) else None
        if not isinstance(results, list) or len(results) != len(requests):
            return [(None, _BAD)] * len(requests)
        return [
            (None, r["error"]) if isinstance(r, dict) and "error" in r else _checked(r)
            for r in results
        ]

    def calibration(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=self.timeout) as response:
                listing = json.loads(response.read())
            info = listing["data"][0]["meta"].get("calibration")
        except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
            return None
        return info if isinstance(info, dict) else None

    def close(self) -> None:
        return None


_BAD = {
    "type": "api_error",
    "code": "bad_response",
    "message": 'the response has no "result" with probabilities',
}


def _checked(result: Any) -> ResultOrError:
    if not isinstance(result, dict) or "probabilities" not in result:
        return None, dict(_BAD)
    return result, None


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
