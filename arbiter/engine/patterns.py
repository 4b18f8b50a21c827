"""A JSON Schema ``pattern`` as GBNF: the characters of a JSON string that the regular expression
matches, written the way JSON writes them.

The converter llama-cpp-python ships copies a pattern's character classes and dots into the
grammar as they are, so a pattern that admits a quote, a backslash or a control character let the
model end the string early or write invalid JSON, and escapes such as ``\\d`` failed to parse. Here
the pattern is read by a small parser of its own and every character it admits is emitted as JSON
text: safe characters as they are, a quote, a backslash or a control character as its escape.

Read: literals, ``.``, classes (``[a-z_]``, ``[^"]``, with ``\\d \\w \\s`` inside), ``\\d \\w
\\s`` (``\\s`` as a space only), escaped metacharacters, groups ``( )`` and ``(?: )``, ``|``,
``* + ? {m} {m,} {m,n}`` (counts up to 1000), ``^`` first and ``$`` last. Anything else (lazy or
possessive quantifiers, backreferences, lookarounds, ``\\b``, named groups) is refused by name.
The grammar generates whole matches of the pattern, which also match it as a search (JSON
Schema's meaning) when it is not anchored. ``.`` and negated classes leave out the characters that
JSON must escape: fewer strings, all of them matches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_REPEAT = 1000
_MAX_CODE_POINT = 0x10FFFF
# Characters JSON writes escaped inside strings (and the surrogates, which UTF-8 cannot carry).
_UNSAFE = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F), (0xD800, 0xDFFF)]
_UNSAFE_CODES = [*range(0x20), 0x22, 0x5C, 0x7F]  # what a JSON string escapes
_CLASSES = {
    "d": [(0x30, 0x39)],
    "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    "s": [(0x20, 0x20)],
}
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
_META = set("\\^$.|?*+()[]{}/-\"'")


class PatternError(ValueError):
    """The pattern uses something the grammar cannot express exactly."""


def pattern_gbnf(pattern: str) -> str:
    """A GBNF expression for the JSON-escaped text of the pattern's whole matches."""
    parser = _Parser(pattern)
    expression = parser.alternatives()
    if parser.i != len(pattern):
        raise PatternError(f"unexpected {pattern[parser.i]!r} at {parser.i}")
    return expression


@dataclass
class _Parser:
    text: str
    i: int = 0

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def take(self) -> str:
        c = self.peek()
        if not c:
            raise PatternError("the pattern ends too early")
        self.i += 1
        return c

    def alternatives(self) -> str:
        options = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"

    def sequence(self) -> str:
        items: list[str] = []
        while self.peek() not in ("", "|", ")"):
            if self.peek() == "^":
                if self.i != 0:
                    raise PatternError("^ only at the start")
                self.i += 1
                continue
            if self.peek() == "$":
                if self.i != len(self.text) - 1:
                    raise PatternError("$ only at the end")
                self.i += 1
                continue
            items.append(self.quantified(self.atom()))
        return " ".join(items) if items else '""'

    def atom(self) -> str:
        c = self.take()
        if c == "(":
            if self.text.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise PatternError("lookarounds and named groups are not supported")
            inner = self.alternatives()
            if self.take() != ")":
                raise PatternError("unbalanced parentheses")
            return f"({inner})"
        if c == "[":
            return _ranges_gbnf(self.char_class())
        if c == ".":
            return _ranges_gbnf(_subtract([(0, _MAX_CODE_POINT)], _UNSAFE))
        if c == "\\":
            ranges = self.escape(in_class=False)
            return _ranges_gbnf(ranges)
        if c in "*+?{":
            raise PatternError(f"{c!r} repeats nothing")
        if c in ")]}":
            raise PatternError(f"unbalanced {c!r}")
        return _literal(c)

    def escape(self, *, in_class: bool) -> list[tuple[int, int]]:
        c = self.take()
        if c in _CLASSES:
            return _CLASSES[c]
        if c in _SIMPLE_ESCAPES:
            code = ord(_SIMPLE_ESCAPES[c])
            return [(code, code)]
        if c in _META or not c.isalnum():  # an escaped non-word character is itself
            return [(ord(c), ord(c))]
        if c in ("x", "u"):
            width = 2 if c == "x" else 4
            digits = self.text[self.i : self.i + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise PatternError(f"\\{c} needs {width} hex digits")
            self.i += width
            code = int(digits, 16)
            return [(code, code)]
        raise PatternError(f"the escape \\{c} is not supported")

    def char_class(self) -> list[tuple[int, int]]:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while first or self.peek() != "]":
            first = False
            low = self.class_member()
            if self.peek() == "-" and self.text[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                high = self.class_member()
                if len(low) != 1 or len(high) != 1 or low[0][0] > high[0][0]:
                    raise PatternError("a bad range in a character class")
                ranges.append((low[0][0], high[0][0]))
            else:
                ranges.extend(low)
        self.i += 1  # the closing ]
        if negated:
            return _subtract(_subtract([(0, _MAX_CODE_POINT)], ranges), _UNSAFE)
        return ranges

    def class_member(self) -> list[tuple[int, int]]:
        c = self.take()
        if c == "\\":
            return self.escape(in_class=True)
        if c == "[":
            raise PatternError("nested classes and POSIX classes are not supported")
        return [(ord(c), ord(c))]

    def quantified(self, atom: str) -> str:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            self.no_lazy()
            return f"{atom}{c}"
        if c == "{":
            end = self.text.find("}", self.i)
            body = self.text[self.i + 1 : end] if end != -1 else ""
            low, _, high = body.partition(",")
            if end == -1 or not low.isdigit() or (high and not high.isdigit()):
                raise PatternError("a quantifier must read {m}, {m,} or {m,n}")
            self.i = end + 1
            self.no_lazy()
            lo, hi = int(low), (int(high) if high else None)
            if lo > MAX_REPEAT or (hi is not None and (hi > MAX_REPEAT or hi < lo)):
                raise PatternError(f"counts up to {MAX_REPEAT}, m <= n")
            if "," not in body:
                return f"{atom}{{{lo}}}"
            return f"{atom}{{{lo},{'' if hi is None else hi}}}"
        return atom

    def no_lazy(self) -> None:
        if self.peek() in ("?", "+"):
            raise PatternError("lazy and possessive quantifiers are not supported")


def _subtract(ranges: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        pieces = [(low, high)]
        for c_low, c_high in cut:
            pieces = [
                part
                for a, b in pieces
                for part in ((a, min(b, c_low - 1)), (max(a, c_high + 1), b))
                if part[0] <= part[1]
            ]
        out.extend(pieces)
    return out


def _ranges_gbnf(ranges: list[tuple[int, int]]) -> str:
    """Characters as JSON writes them: a class of the safe ones, an escape for each other one."""
    safe = _subtract(ranges, _UNSAFE)
    unsafe = [c for c in _UNSAFE_CODES if any(low <= c <= high for low, high in ranges)]
    options = []
    if safe:
        options.append("[" + "".join(_class_char(a, b) for a, b in safe) + "]")
    options.extend(_literal(chr(c)) for c in unsafe)
    if not options:
        raise PatternError("a character class that admits no character")
    return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"


def _class_char(low: int, high: int) -> str:
    def one(code: int) -> str:
        return f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"

    return one(low) if low == high else f"{one(low)}-{one(high)}"


def _literal(char: str) -> str:
    """One character as a GBNF literal of its JSON text (``"`` is ``\\"`` in JSON)."""
    text = json.dumps(char, ensure_ascii=False)[1:-1]
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
