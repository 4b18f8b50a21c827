"""One JSON Lines file, four ways in, the same records: `arbiter decide` (the command's function,
in-process), `POST /invocations` with `Content-Type: application/jsonlines` (a real aiohttp test
client), and an S3 job on the moto server, run whole (``run_job``) and by queue consumers with a
shard size small enough that most generated files are split into shards.

The files are generated (hypothesis) from the cases where the ways in used to disagree: a byte order
mark at the start, ``NaN`` and ``Infinity``, a line that is not UTF-8 (Latin-1), an invalid line
whose ``id`` is an object or a list, blank lines, CRLF line ends and a last line without one. Each
line's record is also checked against what that case must give, so four paths that agree on a
wrong answer still fail.
"""

from __future__ import annotations

import asyncio
import codecs
import io
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from adapter.app import create_app
from arbiter import decide
from arbiter.settings import ServerSettings
from tests.aws import aws_clients, moto_endpoint, read_object, reset_moto
from tests.fakes import FakeEngine
from tests.live_server import ready
from tests.worker.fanout_support import make_consumer, run_until_done
from tests.worker.support import settings_for
from worker.events import JobRef
from worker.jobs import run_job
from worker.outputs import output_keys
from worker.stack import ensure_stack

STATES = ["Order 1182 arrived damaged.", "The customer cannot log in.", {"ticket": 7, "lang": "fr"}]
OPTIONS = [{"id": "a", "description": "first"}, {"id": "b", "description": "second"}]
FIVE = [{"id": f"o{i}", "description": f"option {i}"} for i in range(5)]  # FakeEngine takes 3


def _decision(id_: Any, state: Any, options: list[dict[str, str]] = OPTIONS) -> dict[str, Any]:
    return {"id": id_, "state": state, "question": "Which team?", "options": options}


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()


ids = st.text(alphabet="abz09-é", min_size=1, max_size=6)
states = st.sampled_from(STATES)

# (the line's bytes, what its record must be: "result", "blank", an error code, and its id)
Case = tuple[bytes, str, Any]
cases: st.SearchStrategy[Case] = st.one_of(
    st.builds(lambda i, s: (_dumps(_decision(i, s)), "result", i), ids, states),
    st.builds(lambda i, s: (_dumps(_decision(i, s, FIVE)), "too_many_options", i), ids, states),
    # Latin-1: bytes that are not UTF-8.
    st.builds(
        lambda i, s: (
            json.dumps(_decision(f"caf\u00e9{i}", s), ensure_ascii=False).encode("latin-1"),
            "invalid_json",
            None,
        ),
        ids,
        states,
    ),
    # NaN and Infinity are not JSON, wherever they are.
    st.builds(
        lambda i, s, bad: (
            json.dumps({**_decision(i, s), "temperature": bad}).encode(),
            "invalid_json",
            None,
        ),
        ids,
        states,
        st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    ),
    st.sampled_from([b'{"id": NaN}', b'{"id": "x", "state": Infinity}', b"-Infinity"]).map(
        lambda b: (b, "invalid_json", None)
    ),
    # A schema error: a scalar id is echoed, an object or a list is not.
    st.builds(lambda s: (_dumps(_decision(7, s)), "invalid_field", 7), states),
    st.builds(
        lambda i, s: (_dumps({**_decision(i, s), "question": ""}), "invalid_field", i), ids, states
    ),
    st.sampled_from([{"k": [1]}, [1, 2], None]).map(
        lambda rid: (_dumps({"id": rid, "state": "s"}), "invalid_field", None)
    ),
    st.just((b"{not json", "invalid_json", None)),
    st.sampled_from([b"", b"   ", b"\t", b"\x0c", b" \r"]).map(lambda b: (b, "blank", None)),
)
files = st.fixed_dictionaries(
    {
        "lines": st.lists(st.tuples(cases, st.sampled_from([b"\n", b"\r\n"])), max_size=9),
        "bom": st.booleans(),
        "last_newline": st.booleans(),
    }
)


def _content(lines: list[tuple[Case, bytes]], bom: bool, last_newline: bool) -> bytes:
    body = b"".join(case[0] + end for case, end in lines)
    if lines and not last_newline:
        body = body.removesuffix(lines[-1][1])
    return (codecs.BOM_UTF8 if bom else b"") + body


def _comparable(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records without what differs between two runs (timing)."""
    for record in records:
        if "result" in record:
            record["result"].pop("timing")
    return records


def _parse(data: bytes) -> list[dict[str, Any]]:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in a record: not strict JSON")

    return _comparable([json.loads(line, parse_constant=refuse) for line in data.splitlines()])


# -- the four ways in ------------------------------------------------------------------------------


def _by_decide(content: bytes, tmp: Any) -> list[dict[str, Any]]:
    import argparse

    path = tmp / "in.jsonl"
    path.write_bytes(content)
    out = io.StringIO()
    args = argparse.Namespace(file=str(path), model=None, chunk=4, quiet=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("arbiter.engine.open_engine", lambda model=None: FakeEngine())
        decide.cmd_decide(args, out)
    return _parse(out.getvalue().encode())


async def _by_http(content: bytes) -> list[dict[str, Any]]:
    engine = FakeEngine()
    app = create_app(ServerSettings(max_in_flight=1, max_queue=1, jsonl_chunk=4), lambda: engine)
    async with TestClient(TestServer(app)) as client:
        await ready(client)
        response = await client.post(
            "/invocations", data=content, headers={"Content-Type": "application/jsonlines"}
        )
        assert response.status == 200, await response.text()
        return _parse(await response.read())


async def _by_jobs(content: bytes) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The records of the job run whole (``run_job``), then run by consumers that split it."""
    endpoint = moto_endpoint()
    reset_moto(endpoint)
    whole_settings = settings_for(endpoint, output_prefix="whole/", chunk_decisions=4)
    split_settings = settings_for(endpoint, shard_lines=2, chunk_decisions=4)
    key = "incoming/same.jsonl"
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, split_settings)
        put = await s3.put_object(Bucket="jobs", Key=key, Body=content)
        etag = str(put["ETag"]).strip('"')
        report = await run_job(s3, FakeEngine(), JobRef("jobs", key, etag), whole_settings)
        assert report.keys is not None
        whole = await read_object(s3, "jobs", report.keys.results)
        keys = output_keys(split_settings, key, etag)
        consumer, _ = await make_consumer(split_settings, s3, sqs, FakeEngine())
        await run_until_done([consumer], s3, sqs, stack["queue_url"], keys.summary)
        split = await read_object(s3, "jobs", keys.results)
    return _parse(whole), _parse(split)


# -- the property ----------------------------------------------------------------------------------


def _expected(lines: list[tuple[Case, bytes]]) -> list[tuple[int, str, Any]]:
    return [
        (number, kind, rid)
        for number, ((_, kind, rid), _) in enumerate(lines, 1)
        if kind != "blank"
    ]


# Every case in one file: a BOM, CRLF ends, blank lines between, and no newline after the last.
EVERY_CASE = {
    "lines": [
        ((_dumps(_decision("a1", STATES[0])), "result", "a1"), b"\r\n"),
        ((b"", "blank", None), b"\r\n"),
        (
            (
                json.dumps(_decision("caf\u00e9", STATES[0]), ensure_ascii=False).encode("latin-1"),
                "invalid_json",
                None,
            ),
            b"\n",
        ),
        (
            (
                json.dumps({**_decision("n", STATES[1]), "temperature": float("nan")}).encode(),
                "invalid_json",
                None,
            ),
            b"\r\n",
        ),
        ((_dumps({"id": {"k": [1]}, "state": "s"}), "invalid_field", None), b"\n"),
        ((_dumps(_decision(7, STATES[1])), "invalid_field", 7), b"\n"),
        ((b" \r", "blank", None), b"\n"),
        ((_dumps(_decision("b2", STATES[1], FIVE)), "too_many_options", "b2"), b"\r\n"),
        ((_dumps(_decision("c3", STATES[2])), "result", "c3"), b"\r\n"),
    ],
    "bom": True,
    "last_newline": False,
}


@settings(
    max_examples=10,
    deadline=None,
    # An example costs about a second (a job, a split job, a server); shrinking a failure would
    # take many minutes, and the cases are small enough to read unshrunk.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)
@given(file=files)
@example(file=EVERY_CASE)
def test_one_file_gives_the_same_records_every_way_in(file: dict[str, Any], tmp_path: Any) -> None:
    content = _content(file["lines"], file["bom"], file["last_newline"])
    by_decide = _by_decide(content, tmp_path)
    by_http = asyncio.run(_by_http(content))
    whole, split = asyncio.run(_by_jobs(content))
    assert by_http == by_decide
    assert whole == by_decide
    assert split == by_decide
    got = [
        (r["line"], "result" if "result" in r else r["error"]["code"], r["id"]) for r in by_decide
    ]
    assert got == _expected(file["lines"])
