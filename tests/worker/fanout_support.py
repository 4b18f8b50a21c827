"""Helpers for the fan-out tests: job files with hostile lines, the single path's records to compare
with, consumers driven message by message or in loops, object versions."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from tests.aws import list_keys, read_object, receive_all, s3_notification
from tests.fakes import decision_line
from tests.worker import support
from worker.events import JobRef
from worker.fanout.outcome import ShardOutcome
from worker.jobs import run_job
from worker.outputs import output_keys
from worker.queue import Consumer
from worker.settings import WorkerSettings


def fanout_settings(endpoint: str, **kw: Any) -> WorkerSettings:
    """The worker tests' settings with short lines (small jobs still split)."""
    return support.settings_for(endpoint, **{"max_line_bytes": 400, **kw})


async def done_outputs(
    s3: Any, bucket: str, outputs: Sequence[tuple[str, bytes, int]]
) -> list[ShardOutcome]:
    """Shard outputs written to the store as (key, records, lines), with the outcomes a merge
    reads them by: each shard done, every line ok."""
    outcomes = []
    for index, (key, data, lines) in enumerate(outputs):
        await s3.put_object(Bucket=bucket, Key=key, Body=data)
        outcomes.append(
            ShardOutcome(
                index=index,
                state="done",
                attempt="a",
                output=key,
                bytes=len(data),
                lines=lines,
                ok=lines,
                failed=0,
            )
        )
    return outcomes


def job_lines(n: int, run: int = 3) -> list[bytes]:
    """``n`` decisions, ``run`` in a row per state, with hostile lines among them: not JSON, not
    UTF-8, too long for ``max_line_bytes=400``, a schema error; and blank lines."""
    lines = [
        decision_line(i, state=f"Order {i // run} arrived damaged.").encode() for i in range(n)
    ]
    hostile = [b"{not json", b'{"id": "x\xff\xfe"}', b'{"id": "' + b"L" * 600 + b'"}', b'{"id": 7}']
    for k, bad in enumerate(hostile):
        lines.insert(min(len(lines), (k + 1) * n // 5), bad)
    lines.insert(n // 2, b"")
    lines.insert(n // 2, b"   ")
    return lines


def job_body(lines: Sequence[bytes], suffix: str) -> bytes:
    """The lines as a ``.jsonl``, ``.jsonl.gz`` or ``.json`` (``{"decisions": [...]}``) file."""
    if suffix.endswith(".json") or suffix.endswith(".json.gz"):
        # Bad JSON inside an element is its error; an element that breaks the document's own
        # structure ends the document (a .json property), so that one is left out here.
        elements = [x for x in lines if x.strip() and x != b"{not json"]
        body = b'{"meta": {"k": [1, 2]}, "decisions": [\n' + b",\n".join(elements) + b"\n]}"
    else:
        body = b"\n".join(lines) + b"\n"
    return gzip.compress(body) if suffix.endswith(".gz") else body


def stripped(data: bytes) -> list[dict[str, Any]]:
    """Records without what differs between two runs: timing, and the prefix cache's status."""
    out = []
    for line in data.splitlines():
        record = json.loads(line)
        if "result" in record:
            record["result"].pop("timing")
            record["result"].pop("prefix_cache")
        out.append(record)
    return out


async def single_path(s3: Any, settings: WorkerSettings, key: str, engine: Any) -> bytes:
    """The results the single path writes for ``key`` (under ``single/``, out of the way)."""
    alone = settings.model_copy(update={"output_prefix": "single/"})
    report = await run_job(s3, engine, JobRef("jobs", key), alone, None)
    assert report.keys is not None
    return await read_object(s3, "jobs", report.keys.results)


def outputs(settings: WorkerSettings, key: str, etag: str) -> Any:
    return output_keys(settings, key, etag)


async def versions(s3: Any, key: str) -> int:
    """How many times ``key`` was written (the bucket is versioned in these tests)."""
    got = await s3.list_object_versions(Bucket="jobs", Prefix=key)
    return sum(1 for v in got.get("Versions", []) if v["Key"] == key)


make_consumer = support.make_consumer


def sample(registries: Sequence[CollectorRegistry], name: str, **labels: str) -> float:
    """A metric's value summed over several consumers' registries."""
    return sum(support.sample(r, name, **labels) for r in registries)


job_message = s3_notification


async def shard_messages(sqs: Any, url: str, count: int) -> dict[int, dict[str, Any]]:
    """Receive ``count`` shard messages, by shard index."""
    found: dict[int, dict[str, Any]] = {}
    for _ in range(20):
        for message in await receive_all(sqs, url, wait=1):
            found[json.loads(message["Body"])["index"]] = message
        if len(found) >= count:
            return found
    raise AssertionError(f"only shards {sorted(found)} arrived")


async def pending(sqs: Any, url: str) -> int:
    """Messages visible, in flight or delayed (a deferred one is delayed)."""
    names = [
        "ApproximateNumberOfMessages",
        "ApproximateNumberOfMessagesNotVisible",
        "ApproximateNumberOfMessagesDelayed",
    ]
    got = await sqs.get_queue_attributes(QueueUrl=url, AttributeNames=names)
    return sum(int(got["Attributes"][n]) for n in names)


async def run_until_done(
    consumers: Sequence[Consumer], s3: Any, sqs: Any, url: str, summary: str, within_s: float = 60
) -> None:
    """Run the consumers until the summary exists and the queue is empty, then stop them."""
    tasks = [asyncio.create_task(c.run()) for c in consumers]
    try:
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            if summary in await list_keys(s3, "jobs", summary) and not await pending(sqs, url):
                break
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError("the job did not finish in time")
            await asyncio.sleep(0.2)
    finally:
        for consumer in consumers:
            consumer.stop()
        await asyncio.gather(*tasks)
