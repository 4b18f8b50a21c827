"""The AWS event-stream framing (``application/vnd.amazon.eventstream``), encoding side.

botocore only decodes it (``botocore.eventstream``), so the encoder is here; it is small. A message is
a 12-byte prelude (total length, headers length, CRC32 of those 8 bytes), the headers, the payload,
and a CRC32 of everything before it, all big-endian. Headers here are strings only (type 7).
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

CONTENT_TYPE = "application/vnd.amazon.eventstream"
_STRING = 7
MAX_PAYLOAD = 16 * 1024 * 1024  # botocore refuses a message over 24 MiB; keep well below


def _header(name: str, value: str) -> bytes:
    raw_name, raw_value = name.encode(), value.encode()
    return (
        struct.pack(">B", len(raw_name))
        + raw_name
        + struct.pack(">BH", _STRING, len(raw_value))
        + raw_value
    )


def message(headers: dict[str, str], payload: bytes) -> bytes:
    """One framed message."""
    encoded = b"".join(_header(k, v) for k, v in headers.items())
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack(">II", total, len(encoded))
    prelude += struct.pack(">I", zlib.crc32(prelude))
    body = prelude + encoded + payload
    return body + struct.pack(">I", zlib.crc32(body))


def event(event_type: str, payload: bytes, content_type: str = "application/octet-stream") -> bytes:
    return message(
        {":event-type": event_type, ":content-type": content_type, ":message-type": "event"},
        payload,
    )


def payload_parts(data: bytes) -> list[bytes]:
    """``PayloadPart`` events carrying ``data`` (split only when over the frame limit)."""
    return [
        event("PayloadPart", data[i : i + MAX_PAYLOAD]) for i in range(0, len(data), MAX_PAYLOAD)
    ] or []


def exception(exception_type: str, fields: dict[str, Any]) -> bytes:
    """A modeled error inside the stream (``ModelStreamError``, ``InternalStreamFailure``)."""
    return message(
        {
            ":exception-type": exception_type,
            ":content-type": "application/json",
            ":message-type": "exception",
        },
        json.dumps(fields).encode(),
    )
