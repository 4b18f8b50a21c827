"""JSON in from untrusted callers, JSON out that always encodes.

Every failure Python's ``json`` can raise on hostile input becomes one typed 400, not just
``JSONDecodeError``: nesting past the recursion limit (``RecursionError``), integers over 4,300
digits (``ValueError``), bytes that are not UTF-8, and the non-standard constants ``NaN`` and
``Infinity`` that Python accepts and JSON does not. Output falls back to ASCII escapes when a string
holds a lone surrogate (legal in JSON text, not encodable as UTF-8), so echoing a caller's id can
never break a response.
"""

from __future__ import annotations

import json
from typing import Any

from arbiter.errors import MalformedRequest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def loads(data: bytes | str, what: str = "the body") -> Any:
    """Parse JSON text; any reason it cannot be read is a ``MalformedRequest`` (400)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
        return json.loads(text, parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise MalformedRequest(
            f"{what} is not valid UTF-8: {exc.reason} at byte {exc.start}"
        ) from exc
    except RecursionError as exc:
        raise MalformedRequest(f"{what} is not valid JSON: it is nested too deeply") from exc
    except ValueError as exc:  # JSONDecodeError, integers over 4,300 digits, NaN and Infinity
        raise MalformedRequest(f"{what} is not valid JSON: {exc}") from exc


# Line separators that JSON leaves unescaped but ``str.splitlines`` (and JavaScript before ES2019)
# break lines at: escaped, so a JSON Lines record is one line for any reader.
_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dumps(value: Any, *, strict: bool = False) -> bytes:
    """Compact UTF-8 JSON on one line; strings that UTF-8 cannot hold (lone surrogates) are
    written as ``\\uXXXX`` escapes. ``strict``: a NaN or infinity raises ``ValueError`` rather
    than being written as a constant no JSON parser but Python's reads."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=not strict)
        return text.translate(_LINE_BREAKS).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, allow_nan=not strict).encode("ascii")
