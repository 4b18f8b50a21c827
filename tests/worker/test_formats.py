"""Hostile job files, read in memory: gzip bombs, giant lines, deep nesting, huge numbers, broken
gzip and JSON. Each is one error item beside the good ones, and reading holds only bounded memory."""

from __future__ import annotations

import gzip
import json
import math
import tracemalloc
import zlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from arbiter.errors import ArbiterError
from arbiter.schema import DecisionRequest
from tests.fakes import FakeEngine, decision_line
from worker.formats import items_for
from worker.jobs import JobFailed, write_records
from worker.settings import WorkerSettings

MiB = 1 << 20
DEEP = "[" * 100_000 + "]" * 100_000


async def _pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def _kinds(key: str, data: bytes, size: int = 1 << 16, **kw: Any) -> list[tuple[int, str]]:
    out = []
    async for item in items_for(key, _pieces(data, size), **kw):
        line, value = item[0], item[1]
        assert isinstance(value, ArbiterError | DecisionRequest)
        out.append((line, value.code if isinstance(value, ArbiterError) else "ok"))
    return out


def _gz_stream(parts: list[tuple[bytes, int]]) -> bytes:
    """A gzip member of ``data * times`` for each part, compressed without ever holding it."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    out = []
    for data, times in parts:
        block = data * max(1, MiB // max(1, len(data)))
        left = len(data) * times
        while left > 0:
            piece = block[:left]
            out.append(compressor.compress(piece))
            left -= len(piece)
    out.append(compressor.flush())
    return b"".join(out)


async def _peak_mb(key: str, data: bytes) -> tuple[list[tuple[int, str]], float]:
    tracemalloc.start()
    try:
        kinds = await _kinds(key, data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return kinds, peak / MiB


async def test_a_gzip_bomb_of_newlines_is_read_in_bounded_memory() -> None:
    good = (decision_line(1) + "\n").encode()
    bomb = _gz_stream([(good, 1), (b"\n", 64 * MiB), (good, 1)])
    assert len(bomb) < MiB // 4  # 64 MiB of newlines in ~64 KB
    kinds, peak = await _peak_mb("incoming/bomb.jsonl.gz", bomb)
    assert kinds == [(1, "ok"), (64 * MiB + 2, "ok")]  # every blank line counted, none recorded
    assert peak < 16, f"peak {peak:.0f} MB"


async def test_a_giant_line_is_one_payload_too_large_item_and_not_held() -> None:
    good = (decision_line(1) + "\n").encode()
    data = _gz_stream([(good, 1), (b"x", 48 * MiB), (b"\n" + good, 1)])
    kinds, peak = await _peak_mb("incoming/giant.jsonl.gz", data)
    assert kinds == [(1, "ok"), (2, "payload_too_large"), (3, "ok")]
    assert peak < 24, f"peak {peak:.0f} MB"  # the 6 MB line cap and a few read pieces, not 48 MB


async def test_a_giant_json_element_is_skipped_and_the_next_one_read() -> None:
    head = b'{"decisions": [' + decision_line(1).encode() + b', {"id": "big", "state": "'
    tail = b'"}, ' + decision_line(3).encode() + b"]}"
    data = _gz_stream([(head, 1), (b"a", 40 * MiB), (tail, 1)])
    kinds, peak = await _peak_mb("incoming/giant.json.gz", data)
    assert kinds == [(1, "ok"), (2, "payload_too_large"), (3, "ok")]
    assert peak < 24, f"peak {peak:.0f} MB"


def _line(**fields: Any) -> str:
    base = json.loads(decision_line(0))
    base.update(fields)
    return json.dumps(base)


async def test_deep_nesting_and_huge_numbers_are_one_error_line_each() -> None:
    lines = [
        decision_line(1),
        '{"id": "deep", "state": ' + DEEP + "}",
        DEEP,
        _line(id="huge-float", temperature=1.5).replace("1.5", "1e999999"),
        '{"id": "digits", "state": ' + "7" * 50_000 + "}",
        _line(id="nan", temperature=float("nan")),
        decision_line(7),
    ]
    kinds = await _kinds("incoming/a.jsonl", "\n".join(lines).encode())
    assert kinds == [
        (1, "ok"),
        (2, "invalid_json"),
        (3, "invalid_json"),
        (4, "invalid_field"),
        (5, "invalid_json"),
        (6, "invalid_json"),  # NaN is not JSON, as over HTTP and in `arbiter decide`
        (7, "ok"),
    ]


@pytest.mark.parametrize("size", [1, 3, 1 << 20])
async def test_json_elements_are_found_whatever_their_content(size: int) -> None:
    elements = [
        decision_line(1).encode(),
        b'{"id": "deep", "state": ' + DEEP.encode() + b"}",
        b'{"id": "bad-utf8", "state": "\xff\xfe", "question": "q?"}',
        b'{"id": "escapes", "state": "a \\" ] } [ { \\\\", "x": [1, {"y": "]"}]}',
        b"{'single': 'quotes'}",
        b"123" + b"4" * 5000,
        decision_line(7).encode(),
    ]
    data = b'{"meta": {"note": "ignored [", "n": [1, 2]}, "decisions": [' + b",".join(elements)
    data += b'], "after": ' + DEEP.encode() + b"}"
    if size == 1:
        data = data.replace(DEEP.encode(), b"[" * 1500 + b"]" * 1500)  # still too deep
    kinds = await _kinds("incoming/a.json", data, size)
    assert kinds == [
        (1, "ok"),
        (2, "invalid_json"),
        (3, "invalid_json"),
        (4, "invalid_field"),
        (5, "invalid_json"),
        (6, "invalid_json"),
        (7, "ok"),
    ]


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        ("]} trailing", [(1, "ok"), (2, "invalid_json")]),  # content after the document
        ("]}\n\n", [(1, "ok")]),
        ("] , oops}", [(1, "ok"), (2, "invalid_json")]),
    ],
)
async def test_the_end_of_a_json_document_is_checked(tail: str, expected: list[Any]) -> None:
    data = ('{"decisions": [' + decision_line(1) + tail).encode()
    assert await _kinds("incoming/a.json", data, 2) == expected


async def test_a_json_document_without_decisions_is_an_error_not_an_empty_result() -> None:
    assert await _kinds("incoming/a.json", b'{"decision": []}') == [(1, "invalid_json")]
    assert await _kinds("incoming/a.json", b'{"decisions": []}') == []


async def test_a_utf8_byte_order_mark_is_allowed_at_the_start() -> None:
    bom = b"\xef\xbb\xbf"
    for key, body in (
        ("incoming/a.jsonl", bom + decision_line(1).encode()),
        ("incoming/a.json", bom + b'{"decisions": [' + decision_line(1).encode() + b"]}"),
    ):
        assert await _kinds(key, body, 1) == [(1, "ok")]


async def test_broken_gzip_is_one_error_after_the_lines_read_so_far() -> None:
    good = "\n".join(decision_line(i) for i in range(1, 4)).encode() + b"\n"
    whole = gzip.compress(good + b"\n".join(decision_line(i).encode() for i in range(4, 400)))
    truncated = await _kinds("incoming/a.jsonl.gz", whole[: len(whole) // 2], 64)
    assert truncated[:3] == [(1, "ok"), (2, "ok"), (3, "ok")]
    assert truncated[-1][1] == "invalid_gzip"
    assert [n for n, _ in truncated] == list(range(1, len(truncated) + 1))
    assert await _kinds("incoming/a.jsonl.gz", b"plain text, not gzip\n") == [(1, "invalid_gzip")]
    corrupt = bytearray(gzip.compress(good))
    corrupt[len(corrupt) // 2] ^= 0xFF
    assert (await _kinds("incoming/a.json.gz", bytes(corrupt)))[-1][1] == "invalid_gzip"


class HostileEngine(FakeEngine):
    """Raises on a decision whose state says "boom" (anywhere in the batch), returns NaN for "nan"."""

    def score(self, decisions: Any) -> Any:
        if any(d.state == "boom" for d in decisions):
            raise RecursionError("maximum recursion depth exceeded")
        out = super().score(decisions)
        for i, d in enumerate(decisions):
            if d.state == "nan":
                out[i] = out[i].model_copy(update={"probabilities": [math.nan] * len(d.options)})
        return out


async def _records(engine: Any, lines: list[str], **kw: Any) -> list[dict[str, Any]]:
    import io

    settings = WorkerSettings(**kw)
    out = io.BytesIO()
    data = "\n".join(lines).encode()
    await write_records(engine, items_for("a.jsonl", _pieces(data, 1 << 16)), out, settings)
    return [json.loads(line) for line in out.getvalue().splitlines()]


async def test_a_decision_that_makes_the_engine_raise_is_its_own_error_line() -> None:
    lines = [decision_line(i, state="boom" if i in (3, 6) else "fine") for i in range(1, 9)]
    lines[4] = decision_line(5, state="nan")
    records = await _records(HostileEngine(), lines, chunk_decisions=4)
    assert [r["line"] for r in records] == list(range(1, 9))
    assert [r["id"] for r in records] == [f"d{i}" for i in range(1, 9)]
    errors = {r["line"]: r["error"]["code"] for r in records if "error" in r}
    assert errors == {3: "engine_failure", 5: "engine_failure", 6: "engine_failure"}


async def test_an_engine_that_fails_on_everything_fails_the_job() -> None:
    with pytest.raises(JobFailed, match="every decision"):
        await _records(FakeEngine(fail=True), [decision_line(i) for i in range(3)])
