"""The one JSON Lines reader (``arbiter.lines.LineReader``): whatever pieces the bytes arrive in, the
same numbered lines, as the module doc says they are read; and one record per parsed line."""

from __future__ import annotations

import codecs
import itertools
import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from arbiter.errors import ArbiterError, EngineFailure
from arbiter.lines import LineReader, encode_record, parse_line
from tests.fakes import decision, uniform_result

MAX_LINE = 16


BLANK = b" \t\r\n\x0b\x0c"  # ASCII whitespace, as bytes.strip() takes it


def _reference(content: bytes) -> list[tuple[int, bytes | str]]:
    """The rules, written plainly: a leading BOM dropped, lines split at LF, blank ones left out
    (numbered all the same), a line over the limit (its leading blanks aside: they are skipped
    unread) replaced by its error's code."""
    lines = content.removeprefix(codecs.BOM_UTF8).split(b"\n")
    out: list[tuple[int, bytes | str]] = []
    for number, line in enumerate(lines, 1):
        if len(line.lstrip(BLANK)) > MAX_LINE:
            out.append((number, "payload_too_large"))
        elif line.strip():
            out.append((number, line.lstrip(BLANK)))
    return out


def _read(pieces: list[bytes]) -> list[tuple[int, bytes | str]]:
    reader = LineReader(MAX_LINE)
    return [
        (n, line.code if isinstance(line, ArbiterError) else line.lstrip(BLANK))
        for n, line in reader.lines(pieces)
    ]


def _cut(content: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(content) + 1) for c in cuts} | {0, len(content)})
    return [content[a:b] for a, b in itertools.pairwise(points)]


line_bytes = st.one_of(
    st.binary(max_size=24).map(lambda b: b.replace(b"\n", b"")),
    st.tuples(st.sampled_from([b"", b"  ", b" \t" * 10]), st.integers(14, 18)).map(
        lambda t: t[0] + b"x" * t[1]  # at the limit or just past it, behind leading blanks
    ),
    st.sampled_from([b"", b" ", b"\r", b"\t\x0c", b'{"id": 1}\r', codecs.BOM_UTF8, b"\xef\xbb"]),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(line_bytes, max_size=12),
    st.booleans(),
    st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_lines_are_the_same_in_any_pieces_and_follow_the_rules(
    lines: list[bytes], bom: bool, cuts: list[int]
) -> None:
    content = (codecs.BOM_UTF8 if bom else b"") + b"\n".join(lines)
    expected = _reference(content)
    assert _read([content]) == expected
    assert _read(_cut(content, cuts)) == expected
    assert _read([content[i : i + 1] for i in range(len(content))]) == expected


def test_an_input_shorter_than_a_bom_that_starts_like_one_is_a_line() -> None:
    assert _read([b"\xef", b"\xbb"]) == [(1, b"\xef\xbb")]
    assert _read([codecs.BOM_UTF8]) == []


def test_a_stream_that_stops_says_how_far_it_got() -> None:
    reader = LineReader()
    assert list(reader.feed(b'{"a": 1}\n\n\n{"b"')) == [(1, b'{"a": 1}')]
    assert reader.number == 3  # the next record is line 4's


def test_an_invalid_lines_id_is_echoed_only_when_it_is_a_scalar() -> None:
    assert parse_line(1, b'{"id": 7}').id == 7
    assert parse_line(1, b'{"id": "x", "state": 1}').id == "x"
    assert parse_line(1, b'{"id": {"k": [1]}}').id is None
    assert parse_line(1, b'{"id": [1, 2]}').id is None
    assert parse_line(1, b'{"id": 1e999}').id is None  # infinity is no JSON number
    nan = parse_line(1, b'{"id": "x", "temperature": NaN}')
    assert isinstance(nan.value, ArbiterError) and nan.value.code == "invalid_json"
    latin1 = parse_line(1, '{"id": "caf\u00e9"}'.encode("latin-1"))
    assert isinstance(latin1.value, ArbiterError) and latin1.value.code == "invalid_json"


def test_a_record_is_strict_json_whatever_the_engine_returns() -> None:
    d = decision("d1")
    bad = uniform_result(d).model_copy(update={"probabilities": [math.nan, math.nan]})
    data, outcome = encode_record(3, "d1", bad)
    record = json.loads(data)
    assert isinstance(outcome, EngineFailure)
    assert record["line"] == 3 and record["id"] == "d1"
    assert record["error"]["code"] == "engine_failure"
    good, _ = encode_record(4, "caf\u00e9", uniform_result(d))
    assert good.endswith(b"\n") and json.loads(good)["id"] == "caf\u00e9"
