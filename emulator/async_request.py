"""One accepted ``InvokeEndpointAsync`` request, as it waits in the backlog.

It is plain data that travels as one SQS message body (JSON; an inline body base64-encoded, at most
128,000 bytes, so a message stays well under SQS's 256 KiB), so that what was accepted outlives the
process that accepted it. ``received`` is wall-clock time: a request's ``RequestTTLSeconds`` counts
across a restart.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from emulator.s3io import S3Uri, parse_uri


@dataclass(frozen=True)
class AsyncRequest:
    inference_id: str
    output: S3Uri
    failure: S3Uri | None
    input_location: S3Uri | None
    body: bytes | None
    content_type: str | None
    accept: str | None
    custom_attributes: str | None
    ttl_s: int
    timeout_s: int
    queued_at: float  # the front's clock (seconds; wall clock unless a test gives another)
    received: str  # ISO 8601, UTC: the notification's receivedTime

    def to_message(self) -> str:
        raw = asdict(self)
        for name in ("output", "failure", "input_location"):
            value = getattr(self, name)
            raw[name] = str(value) if value is not None else None
        raw["body"] = base64.b64encode(self.body).decode() if self.body is not None else None
        return json.dumps(raw, separators=(",", ":"))

    @classmethod
    def from_message(cls, text: str) -> AsyncRequest:
        """The request a message carries; ValueError (or KeyError, TypeError) if it is not one."""
        raw: dict[str, Any] = json.loads(text)
        for name in ("output", "failure", "input_location"):
            if raw.get(name) is not None:
                raw[name] = parse_uri(raw[name])
        if raw.get("body") is not None:
            raw["body"] = base64.b64decode(raw["body"], validate=True)
        return cls(**raw)


def salvage(text: str, now: float) -> AsyncRequest | None:
    """What a message that is not a whole request still says: its inference id and locations,
    enough to answer it with a failure (None when it names no output location)."""
    try:
        raw = json.loads(text)
        inference_id, output = raw["inference_id"], parse_uri(raw["output"])
        failure = parse_uri(raw["failure"]) if raw.get("failure") else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(inference_id, str) or not inference_id:
        return None
    received = raw.get("received") if isinstance(raw.get("received"), str) else now_iso()
    return AsyncRequest(
        inference_id, output, failure, None, None, None, None, None, 0, 0, now, received
    )


def iso(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def now_iso() -> str:
    return iso(datetime.now(UTC))
