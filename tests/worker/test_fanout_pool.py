"""Fan-out with `arbiter work` as a real process tree on moto: three worker processes share one large
job; a worker SIGKILLed mid-shard costs that shard, not the job; a 100,000-line job keeps each
worker's memory flat. The fake engine scores (the real one is tests/worker/test_fanout.py's)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
from typing import Any

from tests.aws import aws_clients, list_keys, read_object, wait_for
from tests.fakes import FakeEngine, decision_line
from tests.ports import free_port
from tests.worker.fanout_support import outputs, pending, single_path, stripped, versions
from tests.worker.test_pool import WORK, _peak_rss_mb, _scrape, spawn, worker_env
from worker.settings import WorkerSettings
from worker.stack import ensure_stack

__all__ = ["spawn"]  # the fixture, shared with tests/worker/test_pool.py


def _settings(endpoint: str, **kw: Any) -> WorkerSettings:
    return WorkerSettings(aws_endpoint_url=endpoint, bucket="jobs", **kw)


async def _versioned_stack(s3: Any, sqs: Any, settings: WorkerSettings) -> dict[str, str]:
    stack = await ensure_stack(s3, sqs, settings)
    await s3.put_bucket_versioning(Bucket="jobs", VersioningConfiguration={"Status": "Enabled"})
    return stack


def _job(n: int, run: int = 4) -> bytes:
    return "\n".join(
        decision_line(i, state=f"Order {i // run} arrived.") for i in range(n)
    ).encode()


async def _finished(s3: Any, sqs: Any, url: str, summary: str) -> bool:
    return summary in await list_keys(s3, "jobs", summary) and not await pending(sqs, url)


async def test_three_worker_processes_share_a_job_of_eight_shards(endpoint: str, spawn) -> None:
    port = free_port()
    settings = _settings(endpoint, shard_lines=25)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _versioned_stack(s3, sqs, settings)
        env = worker_env(
            endpoint,
            ARBITER_WORKER_PROCESSES=3,
            ARBITER_SHARD_LINES=25,
            ARBITER_METRICS_PORT=port,
            ARBITER_FAKE_DELAY_S=0.2,
            ARBITER_CHUNK_DECISIONS=5,
        )
        pool = spawn(WORK, env)
        pool.wait_event("worker.ready", count=3)
        put = await s3.put_object(Bucket="jobs", Key="incoming/shared.jsonl", Body=_job(220))
        keys = outputs(settings, "incoming/shared.jsonl", put["ETag"].strip('"'))
        await wait_for(lambda: _finished(s3, sqs, stack["queue_url"], keys.summary), 90)
        samples = _scrape(port)
        summary = json.loads(await read_object(s3, "jobs", keys.summary))
        merged = await read_object(s3, "jobs", keys.results)
        alone = await single_path(s3, settings, "incoming/shared.jsonl", FakeEngine())
        written = (await versions(s3, keys.results), await versions(s3, keys.summary))
        pool.popen.send_signal(signal.SIGTERM)
        assert pool.popen.wait(30) == 0
    count = summary["shards"]["count"]
    scored = {e["pid"] for e in pool.events("shard.done")}
    print(
        f"{count} shards scored by {len(scored)} processes; merge {summary['seconds']['merge']} s"
    )
    assert count >= 8 and written == (1, 1)
    assert stripped(merged) == stripped(alone)
    assert len(scored) == 3 and summary["shards"]["workers"] == 3
    assert samples['arbiter_worker_shards_total{outcome="ok"}'] == count
    assert samples['arbiter_worker_merges_total{outcome="ok"}'] == 1
    assert samples['arbiter_worker_jobs_total{outcome="split"}'] == 1
    assert samples['arbiter_worker_jobs_total{outcome="merged"}'] == 1


async def test_a_worker_killed_mid_shard_costs_one_shard(endpoint: str, spawn) -> None:
    settings = _settings(endpoint, shard_lines=10, visibility_timeout_s=3)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _versioned_stack(s3, sqs, settings)
        env = worker_env(
            endpoint,
            ARBITER_WORKER_PROCESSES=3,
            ARBITER_SHARD_LINES=10,
            ARBITER_VISIBILITY_TIMEOUT_S=3,
            ARBITER_HEARTBEAT_S=1,
            ARBITER_FAKE_DELAY_S=0.5,
            ARBITER_CHUNK_DECISIONS=2,
        )
        pool = spawn(WORK, env)
        pool.wait_event("worker.ready", count=3)
        put = await s3.put_object(Bucket="jobs", Key="incoming/kill.jsonl", Body=_job(80))
        keys = outputs(settings, "incoming/kill.jsonl", put["ETag"].strip('"'))
        [victim] = pool.wait_event("shard.started", within_s=30)[:1]
        await asyncio.sleep(1.0)  # ~2 of its 5 chunks scored
        os.kill(victim["pid"], signal.SIGKILL)
        pool.wait_event("pool.worker_died")
        await wait_for(lambda: _finished(s3, sqs, stack["queue_url"], keys.summary), 90)
        summary = json.loads(await read_object(s3, "jobs", keys.summary))
        merged = await read_object(s3, "jobs", keys.results)
        written = (await versions(s3, keys.results), await versions(s3, keys.summary))
        uploads = await s3.list_multipart_uploads(Bucket="jobs")
        left = await list_keys(s3, "jobs", "shards/")
        pool.popen.send_signal(signal.SIGTERM)
        assert pool.popen.wait(30) == 0
    count = summary["shards"]["count"]
    started = pool.events("shard.started")
    redone = [e for e in started if e["message_id"] == victim["message_id"]]
    print(f"{count} shards, {len(started)} shard receives; the killed one was received again")
    assert written == (1, 1) and not uploads.get("Uploads") and left == []
    assert [(r["line"], r["id"]) for r in stripped(merged)] == [(i + 1, f"d{i}") for i in range(80)]
    assert summary["ok"] == 80 and summary["shards"]["failed"] == []
    assert len(redone) == 2 and redone[1]["receive_count"] == 2  # only the killed shard, again


def _gz_job(n: int) -> bytes:
    states = [
        f"Order {s} arrived damaged; the customer in region {s % 7} wants help." for s in range(97)
    ]
    text = "\n".join(
        decision_line(i, states[(i // 10) % 97], "Refund or replace?") for i in range(n)
    )
    return gzip.compress(text.encode(), compresslevel=1)


# The single path's bound (tests/worker/test_memory.py). The pool's largest worker is the one that
# merged: after a 20,000-line job (two joined parts in flight, as in any merge) its peak may not grow
# by more than this for a job five times larger.
RSS_GROWTH_BOUND_MB = 25


async def test_a_100000_line_job_keeps_each_workers_memory_flat(endpoint: str, spawn) -> None:
    settings = _settings(endpoint, shard_lines=5000)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        env = worker_env(endpoint, ARBITER_WORKER_PROCESSES=3, ARBITER_SHARD_LINES=5000)
        pool = spawn(WORK, env)
        pool.wait_event("worker.ready", count=3)
        peaks = {}
        for name, n in (("warm", 20_000), ("large", 100_000)):
            put = await s3.put_object(
                Bucket="jobs", Key=f"incoming/{name}.jsonl.gz", Body=_gz_job(n)
            )
            keys = outputs(settings, f"incoming/{name}.jsonl.gz", put["ETag"].strip('"'))
            await wait_for(lambda k=keys: _finished(s3, sqs, stack["queue_url"], k.summary), 280)
            pids = {e["pid"] for e in pool.events("worker.ready")}
            peaks[name] = {pid: _peak_rss_mb(pid) for pid in pids}
            summary = json.loads(await read_object(s3, "jobs", keys.summary))
            assert summary["lines"] == summary["ok"] == n
        results_mb = (await s3.head_object(Bucket="jobs", Key=keys.results))[
            "ContentLength"
        ] / 2**20
        pool.popen.send_signal(signal.SIGTERM)
        assert pool.popen.wait(30) == 0
    growth = max(peaks["large"].values()) - max(peaks["warm"].values())
    print(
        f"100k lines in {summary['shards']['count']} shards, results {results_mb:.0f} MB, merge "
        f"{summary['seconds']['merge']} s ({summary['shards']['merge']['parts']} parts); worker peak "
        f"RSS after 20k -> 100k lines: "
        + ", ".join(f"{peaks['warm'][p]:.0f} -> {peaks['large'][p]:.0f} MB" for p in peaks["warm"])
    )
    assert results_mb > 70
    assert growth < RSS_GROWTH_BOUND_MB, peaks
