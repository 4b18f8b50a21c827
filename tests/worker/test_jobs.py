"""Jobs end to end on moto (server mode) with the real bundled engine: S3 drop -> SQS -> results."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from arbiter.engine import Engine
from tests.aws import aws_clients, list_keys, queue_counts, read_object, receive_all
from tests.fakes import FakeEngine, decision_line
from tests.faults.fleet import Fleet
from tests.faults.proxy import Call
from tests.worker.fanout_support import fanout_settings, job_body, job_lines, pending
from tests.worker.support import settings_for
from worker.context import WorkerContext
from worker.events import JobRef
from worker.jobs import run_job
from worker.metrics import WorkerMetrics
from worker.outputs import output_keys
from worker.queue import Consumer, describe_queue
from worker.stack import ensure_stack

STATE_A = "Order 1188 arrived with a cracked screen; the customer wants it fixed fast."
STATE_B = {"ticket": "T-9", "text": "Invoice charged twice this month."}


class CountingEngine:
    """The real engine, counting how many decisions it was asked to score."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model_info = engine.model_info
        self.scored = 0

    def score(self, decisions: Any) -> Any:
        self.scored += len(decisions)
        return self.engine.score(decisions)


async def _until_notified(sqs: Any, url: str) -> list[dict[str, Any]]:
    """Everything on the queue up to the S3 notification (S3's s3:TestEvent comes first)."""
    received: list[dict[str, Any]] = []
    for _ in range(10):
        received += await receive_all(sqs, url, wait=1)
        if any("Records" in m["Body"] for m in received):
            return received
    raise AssertionError("no S3 notification arrived")


async def test_job_with_good_and_bad_lines_keeps_count_and_order(
    endpoint: str, engine: Engine
) -> None:
    settings = settings_for(endpoint, chunk_decisions=3)  # several chunks, states across them
    lines = [
        decision_line(1, STATE_A, "Which team handles this?"),
        "{not json",
        decision_line(3, STATE_B, "Refund or explain?"),
        "",
        json.dumps({"id": "no-options", "state": "x", "question": "q?", "options": []}),
        decision_line(6, STATE_A, "Is this urgent?"),
        decision_line(7, STATE_B, "Which queue?"),
    ]
    counting = CountingEngine(engine)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        await s3.put_object(
            Bucket="jobs", Key="incoming/batch one.jsonl", Body="\n".join(lines).encode()
        )
        messages = await _until_notified(sqs, stack["queue_url"])  # real S3 notifications
        assert any("s3:TestEvent" in m["Body"] for m in messages)
        queue = await describe_queue(sqs, settings)
        assert queue.max_receive_count == settings.max_receive_count + 3 and queue.dlq_url
        metrics = WorkerMetrics(CollectorRegistry())
        consumer = Consumer(WorkerContext(settings, s3, sqs, counting, queue, metrics=metrics))
        for message in messages:
            await consumer.handle(message)

        keys = await list_keys(s3, "jobs", "results/")
        head = await s3.head_object(Bucket="jobs", Key="incoming/batch one.jsonl")
        expected = output_keys(settings, "incoming/batch one.jsonl", head["ETag"].strip('"'))
        assert keys == sorted([expected.results, expected.summary])
        out = [
            json.loads(x) for x in (await read_object(s3, "jobs", expected.results)).splitlines()
        ]
        summary = json.loads(await read_object(s3, "jobs", expected.summary))
        assert await queue_counts(sqs, stack["queue_url"]) == (0, 0)  # acknowledged

    assert [o["line"] for o in out] == [1, 2, 3, 5, 6, 7]  # the blank line 4 is not a job line
    assert [o["id"] for o in out] == ["d1", None, "d3", "no-options", "d6", "d7"]
    assert out[1]["error"]["code"] == "invalid_json"
    assert out[3]["error"]["code"] == "invalid_field" and out[3]["error"]["param"] == "options"
    for o in (out[0], out[2], out[4], out[5]):
        result = o["result"]
        assert result["choice"] in {"access", "billing"}
        assert abs(sum(result["probabilities"]) - 1) < 1e-6
    assert counting.scored == 4
    assert summary["lines"] == 6 and summary["ok"] == 4 and summary["failed"] == 2
    assert summary["errors_by_code"] == {"invalid_field": 1, "invalid_json": 1}
    assert summary["input"]["etag"] == head["ETag"].strip('"')
    assert summary["model"]["sha256"] == engine.model_info.sha256
    assert summary["tokens"]["prompt"] > 0


async def test_gzip_and_json_inputs(endpoint: str, engine: Engine) -> None:
    settings = settings_for(endpoint)
    jsonl_gz = gzip.compress(
        (decision_line(1, STATE_A) + "\n" + decision_line(2, STATE_A, "Escalate?") + "\n").encode()
    )
    doc = {"decisions": [json.loads(decision_line(1, STATE_B)), {"id": "bad"}]}
    json_gz = gzip.compress(json.dumps(doc).encode())
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, settings)
        outputs = {}
        for key, body in (("incoming/a.jsonl.gz", jsonl_gz), ("incoming/b.json.gz", json_gz)):
            await s3.put_object(Bucket="jobs", Key=key, Body=body)
            report = await run_job(s3, engine, JobRef("jobs", key), settings)
            assert report.outcome == "ok" and report.keys
            raw = await read_object(s3, "jobs", report.keys.results)
            outputs[key] = [json.loads(x) for x in raw.splitlines()]
    assert [("result" in o, o["id"]) for o in outputs["incoming/a.jsonl.gz"]] == [
        (True, "d1"),
        (True, "d2"),
    ]
    assert [o["line"] for o in outputs["incoming/b.json.gz"]] == [1, 2]
    assert outputs["incoming/b.json.gz"][1]["error"]["code"] == "invalid_field"


async def test_redelivered_message_is_acknowledged_without_recomputing(
    endpoint: str, engine: Engine
) -> None:
    settings = settings_for(endpoint)
    counting = CountingEngine(engine)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        await s3.put_object(
            Bucket="jobs", Key="incoming/once.jsonl", Body=decision_line(1).encode()
        )
        messages = await _until_notified(sqs, stack["queue_url"])
        queue = await describe_queue(sqs, settings)
        registry = CollectorRegistry()
        metrics = WorkerMetrics(registry)
        consumer = Consumer(WorkerContext(settings, s3, sqs, counting, queue, metrics=metrics))
        for message in messages:
            await consumer.handle(message)
        [message] = [m for m in messages if "Records" in m["Body"]]
        keys = await list_keys(s3, "jobs", "results/")
        first = {k: (await s3.head_object(Bucket="jobs", Key=k))["LastModified"] for k in keys}

        # S3 delivers at least once: the same event again, as a fresh message.
        await sqs.send_message(QueueUrl=stack["queue_url"], MessageBody=message["Body"])
        [again] = await receive_all(sqs, stack["queue_url"], wait=1)
        await consumer.handle(again)
        second = {k: (await s3.head_object(Bucket="jobs", Key=k))["LastModified"] for k in keys}
        assert await queue_counts(sqs, stack["queue_url"]) == (0, 0)
        assert await list_keys(s3, "jobs", "results/") == keys

    assert len(keys) == 2
    assert counting.scored == 1  # the duplicate was not scored again
    assert first == second  # nor rewritten
    assert registry.get_sample_value("arbiter_worker_jobs_total", {"outcome": "duplicate"}) == 1
    assert registry.get_sample_value("arbiter_worker_jobs_total", {"outcome": "ok"}) == 1


async def test_large_results_go_up_as_one_completed_multipart_upload(endpoint: str) -> None:
    settings = settings_for(endpoint, multipart_threshold_mb=0)
    body = "\n".join(decision_line(i) for i in range(50)).encode()
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, settings)
        await s3.put_object(Bucket="jobs", Key="incoming/m.jsonl", Body=body)
        report = await run_job(s3, FakeEngine(), JobRef("jobs", "incoming/m.jsonl"), settings)
        assert report.keys
        head = await s3.head_object(Bucket="jobs", Key=report.keys.results)
        out = (await read_object(s3, "jobs", report.keys.results)).splitlines()
        uploads = await s3.list_multipart_uploads(Bucket="jobs")
    assert head["ETag"].strip('"').endswith("-1")  # a multipart object, one part
    assert len(out) == 50 and json.loads(out[-1])["id"] == "d49"
    assert not uploads.get("Uploads")


async def test_overwritten_input_is_superseded(endpoint: str) -> None:
    settings = settings_for(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, settings)
        await s3.put_object(Bucket="jobs", Key="incoming/x.jsonl", Body=decision_line(1).encode())
        engine = FakeEngine()
        stale = JobRef("jobs", "incoming/x.jsonl", etag="0" * 32)
        report = await run_job(s3, engine, stale, settings)
        assert report.outcome == "superseded" and engine.calls == 0
        assert await list_keys(s3, "jobs", "results/") == []


async def test_a_lone_surrogate_line_is_one_error_line_with_the_real_engine(
    endpoint: str, engine: Engine
) -> None:
    # Whether the schema or the engine refuses it, it must not fail the job or the lines around it.
    settings = settings_for(endpoint)
    lines = [
        decision_line(1, STATE_A),
        decision_line(2, "Order \\ud800 arrived broken.").replace("\\\\ud800", "\\ud800"),
        decision_line(3, STATE_A, "Escalate?"),
    ]
    assert "\\ud800" in lines[1]
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, settings)
        await s3.put_object(Bucket="jobs", Key="incoming/s.jsonl", Body="\n".join(lines).encode())
        report = await run_job(s3, engine, JobRef("jobs", "incoming/s.jsonl"), settings)
        assert report.outcome == "ok" and report.keys
        out = [
            json.loads(x) for x in (await read_object(s3, "jobs", report.keys.results)).splitlines()
        ]
    assert [("result" in o, o["id"]) for o in out] == [(True, "d1"), (False, "d2"), (True, "d3")]
    # The schema's layer answers (the engine's own is tested in tests/arbiter/test_engine_faults.py):
    # with either layer removed, one of the two tests fails.
    assert out[1]["error"]["code"] == "invalid_field" and out[1]["error"]["param"] == "state"


@pytest.mark.parametrize(
    ("suffix", "shard_lines"), [(".jsonl", 30), (".jsonl.gz", 30), (".json", 30), (".jsonl", 0)]
)
async def test_a_job_under_the_shard_size_costs_one_head_and_one_get_of_its_input(
    endpoint: str, suffix: str, shard_lines: int
) -> None:
    """Counted on the way to the S3 server (the fault proxy, forwarding every request): a job
    that fits one shard is located once and read once, whether it was read to be cut (a gzip
    input, whose size says nothing, is counted first) or never cut (``shard_lines=0``)."""
    settings = fanout_settings(endpoint, shard_lines=shard_lines)
    key = f"incoming/once{suffix}"
    requests: Counter[str] = Counter()

    def count(call: Call) -> str:
        if call.service == "s3" and call.key == key:
            requests[call.op] += 1
        return "forward"

    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        put = await s3.put_object(Bucket="jobs", Key=key, Body=job_body(job_lines(20), suffix))
        keys = output_keys(settings, key, put["ETag"].strip('"'))

        async def done() -> bool:
            found = await list_keys(s3, "jobs", keys.summary)
            return keys.summary in found and not await pending(sqs, stack["queue_url"])

        async with Fleet(endpoint, settings, count, workers=1) as fleet:
            await fleet.run_until(done, 45)
        summary = json.loads(await read_object(s3, "jobs", keys.summary))
    assert "shards" not in summary and summary["lines"] == (23 if suffix == ".json" else 24)
    assert dict(requests) == {"HeadObject": 1, "GetObject": 1}
