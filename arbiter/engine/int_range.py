"""Integers between bounds as a grammar: a JSON schema's ``minimum``/``maximum`` (and the exclusive
ones) on an ``integer``, which llama.cpp's server enforces and llama-cpp-python's converter drops.

A range is split into runs of numbers with the same count of digits, and each run into a few
alternatives of digit classes (``12`` to ``345``: ``1 [2-9] | [2-9] [0-9] | [1-2] [0-9]{2} | 3
[0-3] [0-9] | 34 [0-5]``), so every integer in range is written one way (no leading zero, no
``-0``) and nothing else is. ``alternatives`` builds the parts once; ``gbnf`` and ``regex`` write
them as a grammar and as a Python pattern (the tests check the grammar's language through it).

A side left open is capped at ``MAX_DIGITS`` digits, as llama.cpp caps a plain integer
(``[1-9] [0-9]{0,15}``): an unbounded ``{m,}`` lets a sample run to ``max_tokens`` (invalid
JSON) or write 17-digit values. A bound with more digits than that keeps its own count.
"""

from __future__ import annotations

import math

Part = list[tuple[str, str, int]]  # (lowest digit, highest digit, repeats) in order
Alternatives = list[tuple[str, Part]]  # (sign, digits)
MAX_DIGITS = 16  # an open side's most digits, as llama.cpp's plain integer rule


def bounds(schema: dict[str, object]) -> tuple[int | None, int | None]:
    """The inclusive integer bounds of a schema's minimum/maximum/exclusiveMinimum/Maximum."""
    low: int | None = None
    high: int | None = None
    for key, value in schema.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if key == "minimum":
            low = max(low, math.ceil(value)) if low is not None else math.ceil(value)
        elif key == "exclusiveMinimum":
            edge = math.floor(value) + 1
            low = max(low, edge) if low is not None else edge
        elif key == "maximum":
            high = min(high, math.floor(value)) if high is not None else math.floor(value)
        elif key == "exclusiveMaximum":
            edge = math.ceil(value) - 1
            high = min(high, edge) if high is not None else edge
    return low, high


def _same_length(low: str, high: str) -> list[Part]:
    """Numbers from ``low`` to ``high``, both of one length, as digit-class sequences."""
    if not low:
        return [[]]
    if low[0] == high[0]:
        return [[(low[0], low[0], 1), *rest] for rest in _same_length(low[1:], high[1:])]
    n = len(low) - 1
    parts: list[Part] = []
    first, last = int(low[0]), int(high[0])
    if low[1:] != "0" * n:
        parts += [[(low[0], low[0], 1), *rest] for rest in _same_length(low[1:], "9" * n)]
        first += 1
    tail_full = high[1:] == "9" * n
    if not tail_full:
        last -= 1
    if first <= last:
        parts.append([(str(first), str(last), 1), *([("0", "9", n)] if n else [])])
    if not tail_full:
        parts += [[(high[0], high[0], 1), *rest] for rest in _same_length("0" * n, high[1:])]
    return parts


def _naturals(low: int, high: int) -> list[Part]:
    """Non-negative integers from ``low`` (>= 0) to ``high``."""
    parts: list[Part] = []
    digits = len(str(low))
    while low <= high:
        run_end = 10**digits - 1
        if run_end >= high:
            parts += _same_length(str(low), str(high))
            break
        parts += _same_length(str(low), str(run_end))
        low, digits = run_end + 1, digits + 1
    return parts


def _open_end(bound: int) -> int:
    """The largest magnitude an open side reaches from ``bound``: ``MAX_DIGITS`` digits, or as
    many as the bound itself has."""
    return int(10 ** max(MAX_DIGITS, len(str(abs(bound))))) - 1


def alternatives(low: int | None, high: int | None) -> Alternatives:
    """Every integer from ``low`` to ``high`` (None: open, up to ``MAX_DIGITS`` digits), as
    signed digit sequences."""
    if low is not None and high is not None and low > high:
        raise ValueError(f"no integer is at least {low} and at most {high}")
    if low is None:
        low = -_open_end(high or 0)
    if high is None:
        high = _open_end(low)
    alts: Alternatives = []
    if low < 0:
        # Negative numbers: "-" and the naturals from max(1, -high) to -low.
        alts += [("-", part) for part in _naturals(1 if high >= 0 else -high, -low)]
    if high >= 0:
        alts += [("", part) for part in _naturals(max(0, low), high)]
    return alts


def gbnf(low: int | None, high: int | None) -> str:
    """A GBNF expression for the integers from ``low`` to ``high``."""

    def cls(lo: str, hi: str) -> str:
        return f'"{lo}"' if lo == hi else f"[{lo}-{hi}]"

    def rep(count: int) -> str:
        return "" if count == 1 else "{" + str(count) + "}"

    parts = []
    for sign, part in alternatives(low, high):
        pieces = ['"-"'] if sign else []
        pieces += [cls(lo, hi) + rep(count) for lo, hi, count in part]
        parts.append(" ".join(pieces))
    return "(" + " | ".join(parts) + ")"


def regex(low: int | None, high: int | None) -> str:
    """The same language as a Python regular expression (for the tests)."""

    def cls(lo: str, hi: str) -> str:
        return lo if lo == hi else f"[{lo}-{hi}]"

    def rep(count: int) -> str:
        return "" if count == 1 else "{" + str(count) + "}"

    parts = []
    for sign, part in alternatives(low, high):
        parts.append(("-" if sign else "") + "".join(cls(lo, hi) + rep(c) for lo, hi, c in part))
    return "(?:" + "|".join(parts) + ")"
