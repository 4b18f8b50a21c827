"""A large job is streamed: the worker's memory does not grow with the job's size.

Two gzip jobs, 10,000 and 100,000 lines, each run by `run_job` in a fresh process with an instant fake
engine (the model's own memory is not what is measured here). The 100k job's results are ~80 MB, yet
the process's peak RSS may grow by far less than that between the two runs.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

from tests import ROOT
from tests.aws import aws_clients
from tests.fakes import decision_line
from worker.settings import WorkerSettings
from worker.stack import ensure_stack

RUN_JOB = """
import asyncio, json, resource, sys
from tests.aws import aws_clients
from tests.fakes import FakeEngine
from worker.events import JobRef
from worker.jobs import run_job
from worker.settings import WorkerSettings

async def main(endpoint, key):
    settings = WorkerSettings(aws_endpoint_url=endpoint, bucket="jobs")
    async with aws_clients(endpoint) as (s3, _):
        report = await run_job(s3, FakeEngine(), JobRef(bucket="jobs", key=key), settings)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"status": report.outcome, "lines": report.summary["lines"], "peak_mb": peak_mb}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _job(lines: int) -> bytes:
    states = [
        f"Order {s} arrived damaged; the customer in region {s % 7} wants help." for s in range(97)
    ]
    text = "\n".join(
        decision_line(i, states[i % len(states)], "Refund or replace?") for i in range(lines)
    )
    return gzip.compress(text.encode(), compresslevel=1)


def _run(endpoint: str, key: str) -> dict[str, float]:
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    proc = subprocess.run(
        [sys.executable, "-c", RUN_JOB, endpoint, key],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


async def test_memory_stays_flat_as_the_job_grows(endpoint: str) -> None:
    settings = WorkerSettings(aws_endpoint_url=endpoint, bucket="jobs")
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, settings)
        for name, lines in (("small", 10_000), ("large", 100_000)):
            await s3.put_object(Bucket="jobs", Key=f"other/{name}.jsonl.gz", Body=_job(lines))
    small = _run(endpoint, "other/small.jsonl.gz")
    large = _run(endpoint, "other/large.jsonl.gz")
    assert (small["lines"], large["lines"]) == (10_000, 100_000)
    assert small["status"] == large["status"] == "ok"
    async with aws_clients(endpoint) as (s3, _):
        listing = await s3.list_objects_v2(Bucket="jobs", Prefix="results/other/large")
    results_mb = max(o["Size"] for o in listing["Contents"]) / 2**20
    assert results_mb > 70  # the output really is large
    growth = large["peak_mb"] - small["peak_mb"]
    print(
        f"peak RSS {small['peak_mb']:.0f} -> {large['peak_mb']:.0f} MB; results {results_mb:.0f} MB"
    )
    assert growth < 25, (small, large, results_mb)
