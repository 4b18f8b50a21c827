"""Generated job files (hypothesis): whatever a job file holds, its results have exactly one record per
non-blank line (JSON Lines) or per element (``{"decisions": [...]}``), in input order, every record
is strict JSON, and reading and scoring never raise.

The bounded runs are part of `make test`; the tests marked ``fuzz`` check the same properties with
many more examples (`pytest -m fuzz`, run by `make fuzz`).
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.aws import aws_clients, moto_endpoint, read_object, reset_moto
from tests.fakes import FakeEngine
from worker.events import JobRef
from worker.formats import items_for
from worker.jobs import run_job, write_records
from worker.settings import WorkerSettings
from worker.stack import ensure_stack

MAX_LINE = 4096  # a small cap, so that giant lines and elements are cheap to generate
SETTINGS = WorkerSettings(max_line_bytes=MAX_LINE, chunk_decisions=7)
BLANK = b" \t\r\n\x0b\x0c"

quick = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
long = settings(
    max_examples=10_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- strategies ------------------------------------------------------------------------------------

texts = st.text(min_size=1, max_size=40).filter(str.strip)


def _decision(id_: str, state: Any, question: str = "Route?") -> dict[str, Any]:
    return {
        "id": id_,
        "state": state,
        "question": question,
        "options": [{"id": "a", "description": "first"}, {"id": "b", "description": "second"}],
    }


good_decisions = st.builds(_decision, texts, texts, texts)
json_values = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _nested(n: int) -> bytes:
    return b"[" * n + b"]" * n


# Raw items: (bytes, what is known about their record: "ok", "too_large" or "any").
hostile_items = st.one_of(
    st.integers(1, 3 * MAX_LINE).map(lambda n: (_nested(n // 2 + 1), "any")),
    st.integers(1, 5000).map(lambda k: (b'{"id": "n", "state": ' + b"9" * k + b"}", "any")),
    st.integers(MAX_LINE + 1, 4 * MAX_LINE).map(lambda n: (b'"' + b"x" * n + b'"', "too_large")),
    st.sampled_from([b"NaN", b"-Infinity", b'{"id": NaN}', b'{"id": 1e999}', b"1e99999"]).map(
        lambda b: (b, "any")
    ),
    st.sampled_from([b'"\\ud800"', b'{"id": "\\udfff", "state": "\\ud800"}', b'"\xff\xfe"']).map(
        lambda b: (b, "any")
    ),
    json_values.map(lambda v: (json.dumps(v).encode(), "any")),
    good_decisions.map(lambda d: (json.dumps(d).encode(), "ok")),
    good_decisions.map(lambda d: (json.dumps(d, ensure_ascii=False).encode(), "ok")),
)
jsonl_lines = st.one_of(
    hostile_items,
    st.sampled_from([b"", b" ", b"\t", b"\r", b" \r ", b"\x0c"]).map(lambda b: (b, "blank")),
    st.binary(max_size=300).map(lambda b: (b.replace(b"\n", b""), "any")),
)


# -- running ---------------------------------------------------------------------------------------


async def _pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def _strict(line: bytes) -> dict[str, Any]:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in a record: not strict JSON")

    record: dict[str, Any] = json.loads(line, parse_constant=refuse)
    assert set(record) in ({"line", "id", "result"}, {"line", "id", "error"}), record
    return record


def records_for(key: str, content: bytes, piece: int) -> list[dict[str, Any]]:
    """The records a job file gives, read in pieces of ``piece`` bytes (fake engine, no S3)."""
    out = io.BytesIO()

    async def run() -> None:
        items = items_for(key, _pieces(content, piece), max_item_bytes=MAX_LINE)
        await write_records(FakeEngine(), items, out, SETTINGS)

    asyncio.run(run())
    return [_strict(line) for line in out.getvalue().splitlines()]


def _check_jsonl(lines: list[tuple[bytes, str]], gz: bool, trailing: bool, piece: int) -> None:
    content = b"\n".join(data for data, _ in lines) + (b"\n" if trailing else b"")
    key = "job.jsonl"
    if gz:
        content, key = gzip.compress(content, compresslevel=1), key + ".gz"
    records = records_for(key, content, piece)
    expected = [(n, kind) for n, (data, kind) in enumerate(lines, 1) if data.strip(BLANK)]
    assert [r["line"] for r in records] == [n for n, _ in expected]
    for record, (_, kind) in zip(records, expected, strict=True):
        if kind == "ok":
            assert "result" in record, record
        elif kind == "too_large":
            assert record["error"]["code"] == "payload_too_large"


def _check_json(
    items: list[tuple[bytes, str]], before: bool, gz: bool, space: bytes, piece: int
) -> None:
    head = b'{"meta": {"n": [1, {"x": "]"}]}, ' if before else b"{"
    content = head + b'"decisions":' + space + b"[" + (b"," + space).join(d for d, _ in items)
    content += space + b"]" + space + b"}"
    key = "job.json"
    if gz:
        content, key = gzip.compress(content, compresslevel=1), key + ".gz"
    records = records_for(key, content, piece)
    assert [r["line"] for r in records] == list(range(1, len(items) + 1))
    for record, (_, kind) in zip(records, items, strict=True):
        if kind == "ok":
            assert "result" in record, record
        elif kind == "too_large":
            assert record["error"]["code"] == "payload_too_large"


def _check_any_bytes(content: bytes, key: str, piece: int) -> None:
    records = records_for(key, content, piece)
    numbers = [r["line"] for r in records]
    assert numbers == sorted(set(numbers))
    if key.endswith((".json", ".json.gz")):
        assert numbers == list(range(1, len(numbers) + 1))
    else:
        assert len(numbers) <= content.count(b"\n") + 1 or key.endswith(".gz")


jsonl_args = {
    "lines": st.lists(jsonl_lines, max_size=25),
    "gz": st.booleans(),
    "trailing": st.booleans(),
    "piece": st.integers(1, 9000),
}
json_args = {
    "items": st.lists(hostile_items, max_size=20),
    "before": st.booleans(),
    "gz": st.booleans(),
    "space": st.sampled_from([b"", b" ", b"\n\t "]),
    "piece": st.integers(1, 9000),
}
bytes_args = {
    "content": st.binary(max_size=3000),
    "key": st.sampled_from(["a.jsonl", "a.json", "a.jsonl.gz", "a.json.gz"]),
    "piece": st.integers(1, 700),
}


def _both(check: Callable[..., None], args: dict[str, Any]) -> tuple[Any, Any]:
    """The bounded test for `make test` and its long `fuzz` version."""
    return quick(given(**args)(check)), pytest.mark.fuzz(long(given(**args)(check)))


test_any_jsonl_job_gives_one_record_per_line, test_fuzz_jsonl = _both(_check_jsonl, jsonl_args)
test_any_json_job_gives_one_record_per_element, test_fuzz_json = _both(_check_json, json_args)
test_any_bytes_never_fail_the_job, test_fuzz_any_bytes = _both(_check_any_bytes, bytes_args)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(lines=st.lists(jsonl_lines, min_size=1, max_size=12), gz=st.booleans())
def test_generated_jobs_complete_on_s3(lines: list[tuple[bytes, str]], gz: bool) -> None:
    """The same property through `run_job` on the moto server: upload, read, score, write."""
    endpoint = moto_endpoint()
    reset_moto(endpoint)
    content = b"\n".join(data for data, _ in lines)
    key = "incoming/gen.jsonl" + (".gz" if gz else "")
    body = gzip.compress(content) if gz else content
    settings_ = WorkerSettings(aws_endpoint_url=endpoint, bucket="jobs", max_line_bytes=MAX_LINE)

    async def run() -> tuple[dict[str, Any], bytes]:
        async with aws_clients(endpoint) as (s3, sqs):
            await ensure_stack(s3, sqs, settings_)
            await s3.put_object(Bucket="jobs", Key=key, Body=body)
            report = await run_job(s3, FakeEngine(), JobRef("jobs", key), settings_)
            assert report.outcome == "ok" and report.keys and report.summary
            return report.summary, await read_object(s3, "jobs", report.keys.results)

    summary, results = asyncio.run(run())
    records = [_strict(line) for line in results.splitlines()]
    expected = [n for n, (data, _) in enumerate(lines, 1) if data.strip(BLANK)]
    assert [r["line"] for r in records] == expected
    assert summary["lines"] == len(expected) == summary["ok"] + summary["failed"]
