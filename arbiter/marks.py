"""The caller's strings carried through a chat template as marks, and placed as text.

A string of the caller's that could hold a control token's text (every message, a name or keyword
value with markup) enters the template as a mark, ``\\0ArbiterText{i}:\\0``; where the rendered text
holds the mark, ``prompt.render_chat`` places the caller's string as text (tokenized without
special-token parsing), so it never becomes a control token. A template that encodes the value on
the way keeps its encoding in the mark: ``tojson`` appends ``j`` (``a`` with ``ensure_ascii``),
Python's ``repr`` (``string`` of a list or mapping, a mapping printed whole) appends ``r``. The text
placed is then what the template would have written for the caller's string.

A mark the template changes any other way (``lower``, slicing, a mark inside a longer string that is
then ``repr``'d) no longer reads as one; ``residue`` finds what is left of it so the request can be
refused. The mark's mixed case is so that every case filter changes it.
"""

from __future__ import annotations

import json
import re
from typing import Any

MARKS = re.compile("\u0000ArbiterText([0-9]+):([jar]*)\u0000")
# What a caller's string must not hold to reach the template as it is: a mark's name.
NAME = re.compile("arbitertext", re.IGNORECASE)
_RESIDUE = re.compile("arbitertext([0-9]*)", re.IGNORECASE)
# What a mark is written as while ``json.dumps`` runs: characters it never escapes, and that a
# caller's string never holds as it is (``<`` and ``|`` are markup, so such a string is a mark).
_HELD = re.compile(r"<\|ArbiterText([0-9]+):([jar]*)\|>")


def mark(index: int, codes: str = "") -> str:
    return f"\u0000ArbiterText{index}:{codes}\u0000"


class Mark(str):
    """A mark as the template is given it: ``repr`` of it (inside ``string`` of a list or a
    mapping) is a mark that says so. It keeps the caller's string for ``tojson``'s ``sort_keys``,
    under a name the sandbox does not let a template read."""

    _index: int
    _text: str

    def __new__(cls, index: int, text: str) -> Mark:
        self = super().__new__(cls, mark(index))
        self._index = index
        self._text = text
        return self

    def __repr__(self) -> str:
        return mark(self._index, "r")


def placed(text: str, codes: str) -> str:
    """The caller's ``text`` as the template wrote it: each encoding in ``codes``, in order."""
    for code in codes:
        text = repr(text) if code == "r" else json.dumps(text, ensure_ascii=code == "a")[1:-1]
    return text


def residue(text: str) -> re.Match[str] | None:
    """What is left of a mark the template changed, if ``text`` (template text) holds any."""
    return _RESIDUE.search(text) or re.search("\u0000()", text)


def _held(value: Any, sort_keys: bool) -> Any:
    if isinstance(value, str):
        return MARKS.sub(lambda m: f"<|ArbiterText{m[1]}:{m[2]}|>", value)
    if isinstance(value, dict):
        items = list(value.items())
        if sort_keys:
            items.sort(key=lambda item: item[0]._text if isinstance(item[0], Mark) else item[0])
        return {_held(k, False): _held(v, sort_keys) for k, v in items}
    if isinstance(value, list | tuple):
        return [_held(v, sort_keys) for v in value]
    return value


def to_json(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``tojson`` as transformers defines it (``json.dumps``; Jinja's own escapes ``<``, ``>``,
    ``&`` and ``'``), each mark in the value's strings written as a mark that adds the encoding:
    the caller's string is placed JSON-escaped where the template wrote it."""
    code = "a" if ensure_ascii else "j"
    text = json.dumps(
        _held(value, sort_keys),
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=False,
    )
    return _HELD.sub(lambda m: mark(int(m[1]), m[2] + code), text)
