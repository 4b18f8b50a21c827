"""Helpers for the fan-out tests: job files with hostile lines, the single path's records to compare
with, consumers driven message by message or in loops, object versions."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from tests.worker_support import decision_line, list_keys, read_object, receive_all
from worker.events import JobRef
from worker.jobs import output_keys, run_job
from worker.metrics import WorkerMetrics
from worker.queue import Consumer, describe_queue
from worker.settings import WorkerSettings


def fanout_settings(endpoint: str, **kw: Any) -> WorkerSettings:
    base: dict[str, Any] = {
        "aws_endpoint_url": endpoint,
        "bucket": "jobs",
        "wait_time_s": 1,
        "visibility_timeout_s": 30,
        "backoff_base_s": 0,
        "max_line_bytes": 400,
        "merge_claim_ttl_s": 2,
    }
    return WorkerSettings(**{**base, **kw})


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


async def make_consumer(
    settings: WorkerSettings, s3: Any, sqs: Any, engine: Any, **kw: Any
) -> tuple[Consumer, CollectorRegistry]:
    registry = CollectorRegistry()
    queue = await describe_queue(sqs, settings)
    return Consumer(settings, s3, sqs, engine, queue, WorkerMetrics(registry), **kw), registry


def sample(registries: Sequence[CollectorRegistry], name: str, **labels: str) -> float:
    return sum(r.get_sample_value(name, labels or None) or 0.0 for r in registries)


async def job_message(sqs: Any, url: str) -> dict[str, Any]:
    """The next S3 notification on the queue (S3's test event is dropped)."""
    for _ in range(10):
        for message in await receive_all(sqs, url, wait=1):
            if "Records" in message["Body"]:
                return message
            await sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
    raise AssertionError("no S3 notification arrived")


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
