"""`arbiter transform` in bounded memory: ``SplitType=None`` with ``MaxPayloadInMB=0`` posts an object
as one chunked request streamed from S3 and streams the answer into the output (never holding
either whole: measured on the command as a process of its own); an object over a payload limit is
refused before a byte is sent; a line over the limit is refused while it is still being read (a
gzip bomb never inflates past it)."""

from __future__ import annotations

import json
import zlib
from typing import Any

import pytest
from aiohttp import web

from bench.transform_bench import MB, object_of, peak_rss_mb, transform_env
from tests.emulator.support import BUCKET, container, stand_in
from tests.emulator.test_transform import IN, OUT, direct, essentials, transform
from tests.fakes import decision_line
from tests.live_server import serve

pytestmark = pytest.mark.timeout(300)


def echo(seen: list[dict[str, Any]]) -> web.Application:
    """A container that streams its request body back as it reads it, recording each request's
    headers and how many bytes it read."""

    async def invocations(request: web.Request) -> web.StreamResponse:
        record: dict[str, Any] = {"headers": dict(request.headers), "bytes": 0}
        seen.append(record)
        response = web.StreamResponse()
        await response.prepare(request)
        async for chunk in request.content.iter_chunked(MB):
            record["bytes"] += len(chunk)
            await response.write(chunk)
        await response.write_eof()
        return response

    async def ping(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/ping", ping)
    app.router.add_post("/invocations", invocations)
    return app


def test_split_none_payload_0_streams_a_large_object_in_bounded_memory(
    endpoint: str, local_s3: Any
) -> None:
    """96 MB through `arbiter transform` (a process of its own): one request, chunked, the output
    byte for byte; its peak RSS grows by less than half the object over the same command on 1 MB
    (a transform that held the object would grow by the object at least)."""
    size = 96
    for mb in (1, size):
        local_s3.put_object(Bucket=BUCKET, Key=f"transform/in-{mb}/o.jsonl", Body=object_of(mb))
    seen: list[dict[str, Any]] = []
    peaks = {}
    with serve(echo(seen)) as url:
        for mb in (1, size):
            code, peaks[mb] = peak_rss_mb(
                [
                    "transform",
                    f"s3://{BUCKET}/transform/in-{mb}/",
                    f"s3://{BUCKET}/transform/out-{mb}/",
                    "--split-type",
                    "None",
                    "--max-payload-mb",
                    "0",
                    "--container-url",
                    url,
                ],
                transform_env(endpoint),
            )
            assert code == 0
    big = seen[-1]
    assert len(seen) == 2 and big["bytes"] == size * MB
    assert big["headers"].get("Transfer-Encoding") == "chunked"  # as AWS sends MaxPayloadInMB=0
    assert "Content-Length" not in big["headers"]
    out = local_s3.get_object(Bucket=BUCKET, Key=f"transform/out-{size}/o.jsonl.out")["Body"]
    got = out.read()
    assert len(got) == size * MB + 1 and got[:-1] == object_of(size)  # AssembleWith=Line: + \n
    assert peaks[size] - peaks[1] < size / 2, peaks


def test_an_object_over_max_payload_is_refused_before_a_byte_is_sent(
    local_s3: Any, capsys: Any
) -> None:
    local_s3.put_object(Bucket=BUCKET, Key="transform/in/big.jsonl", Body=b"x" * (MB + 1))
    local_s3.put_object(Bucket=BUCKET, Key="transform/in/small.jsonl", Body=b"y\n")
    with stand_in() as (fake, url):
        code, summary = transform(
            capsys, "--container-url", url, "--split-type", "None", "--max-payload-mb", "1"
        )
    assert code == 1
    assert summary["FailedObjects"] == [
        {
            "input": f"{IN}big.jsonl",
            "reason": f"ClientError: an object of {MB + 1} bytes is over MaxPayloadInMB (1 MB)",
        }
    ]
    assert [s["body"] for s in fake.seen] == [b"y\n"]  # the other object went on
    assert int(fake.seen[0]["headers"]["Content-Length"]) == 2  # a limit: sent with its length


def _gzip_bomb(inflated_mb: int, line_end: bool = False) -> bytes:
    """``inflated_mb`` MiB of one line of ``x`` (a few hundred kB compressed)."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b"x" * MB
    parts = [deflate.compress(block) for _ in range(inflated_mb)]
    return b"".join([*parts, deflate.compress(b"\n" if line_end else b""), deflate.flush()])


@pytest.mark.parametrize("split", ["Line", "None"])
def test_a_gzip_bomb_is_refused_once_it_inflates_past_the_limit(
    local_s3: Any, capsys: Any, split: str
) -> None:
    """256 MB of one line, gzipped to a few hundred kB, with MaxPayloadInMB=1: refused with at
    most a read's worth over the limit inflated (not the 256 MB, not once the line is whole)."""
    local_s3.put_object(Bucket=BUCKET, Key="transform/in/bomb.jsonl.gz", Body=_gzip_bomb(256))
    with stand_in() as (fake, url):
        code, summary = transform(
            capsys,
            "--container-url",
            url,
            "--compression",
            "Gzip",
            "--split-type",
            split,
            "--max-payload-mb",
            "1",
        )
    assert code == 1
    reason = summary["FailureReason"]
    assert "of at least" in reason and "over MaxPayloadInMB (1 MB)" in reason, reason
    held = int(reason.split("of at least ")[1].split(" bytes")[0])
    assert MB < held <= 2 * MB + 1, reason
    assert "Contents" not in local_s3.list_objects_v2(Bucket=BUCKET, Prefix="transform/out/")
    if split == "Line":
        assert fake.seen == []


@pytest.mark.real_model
def test_split_none_payload_0_through_the_real_container(
    engine: Any, local_s3: Any, capsys: Any
) -> None:
    """The real adapter reads a chunked JSON Lines body: the .out is what it answers directly."""
    body = "\n".join(decision_line(i) for i in range(3)) + "\n"
    local_s3.put_object(Bucket=BUCKET, Key="transform/in/whole.jsonl", Body=body.encode())
    with container(engine, batch_max_payload_mb=6) as url:
        code, summary = transform(
            capsys, "--container-url", url, "--split-type", "None", "--max-payload-mb", "0"
        )
        answer = direct(url, body.encode())
    assert code == 0, summary
    assert summary["Objects"][0]["mini_batches"] == 1 and summary["Objects"][0]["records"] == 1
    out = local_s3.get_object(Bucket=BUCKET, Key="transform/out/whole.jsonl.out")["Body"].read()
    assert [essentials(x) for x in out.splitlines()] == [essentials(x) for x in answer.splitlines()]
    assert [json.loads(x)["line"] for x in out.splitlines()] == [1, 2, 3]
    assert OUT.endswith("/transform/out/")
