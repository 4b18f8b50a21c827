"""The black-box run, tried as a new user would: `arbiter work` (a pool of worker processes) and
`arbiter submit`, on a local S3/SQS endpoint, with a loopback proxy in front of the endpoint that
loses the answers of committed writes, answers SQS deletes without deleting and refuses requests
with 503 SlowDown, while worker processes are SIGKILLed at random (the pool restarts them). Every
job must finish with every line once, in order, the single path's records, a true summary, a
finished status, nothing left behind and an empty DLQ.

    python -m tests.worker.blackbox                 # make faults; prints its figures as JSON
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tests import ROOT
from tests.aws import aws_clients, moto_endpoint, reset_moto, wait_for
from tests.fakes import FakeEngine
from tests.faults.proxy import Call, FaultProxy
from tests.worker.fanout_support import job_body, job_lines, pending
from tests.worker.invariants import Job, single_path_records, violations
from tests.worker.test_pool import Proc, worker_env
from worker.jobs import output_keys
from worker.settings import WorkerSettings
from worker.stack import ensure_stack


class RandomFaults:
    """Each request: its committed write's answer lost, a 503, or an SQS delete faked, by chance."""

    def __init__(self, seed: int, lose: float, slow_down: float, fake_delete: float) -> None:
        self.rng = random.Random(seed)
        self.lose, self.slow_down, self.fake_delete = lose, slow_down, fake_delete

    def __call__(self, call: Call) -> str:
        roll = self.rng.random()
        if call.op in ("DeleteMessage", "DeleteMessageBatch") and roll < self.fake_delete:
            return "fake_delete"
        if call.write and roll < self.lose:
            return "lose_response"
        if roll > 1 - self.slow_down:
            return "fail_503"
        return "forward"


def _live_workers(pool: Proc) -> dict[int, int]:
    """Worker slot -> pid of its latest process."""
    live: dict[int, int] = {}
    for event in pool.events("pool.worker_started"):
        live[int(event["worker"])] = int(event["worker_pid"])
    return live


async def _killer(
    pool: Proc, rng: random.Random, every: tuple[float, float], kills: list[int]
) -> None:
    while True:
        await asyncio.sleep(rng.uniform(*every))
        live = _live_workers(pool)
        if live:
            pid = rng.choice(sorted(live.values()))
            try:
                os.kill(pid, signal.SIGKILL)
                kills.append(pid)
            except ProcessLookupError:
                pass


def _submit(env: dict[str, str], path: Path, timeout_s: float) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "arbiter", "submit", str(path), "--timeout", str(timeout_s)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"arbiter submit {path.name}: {done.returncode}\n{done.stderr[-2000:]}"
        )
    return dict(json.loads(done.stdout))


async def blackbox(
    seed: int = 19,
    jobs: int = 3,
    lines: int = 240,
    shard_lines: int = 40,
    processes: int = 2,
    kill_every: tuple[float, float] = (0.3, 1.2),
    timeout_s: float = 300,
    engine_delay_s: float = 0.08,
) -> dict[str, Any]:
    """One black-box run (see the module doc); its figures, and what did not hold."""
    started = time.monotonic()
    endpoint = moto_endpoint()
    reset_moto(endpoint)
    rng = random.Random(seed)
    settings = WorkerSettings(aws_endpoint_url=endpoint, bucket="jobs", max_line_bytes=400)
    faults = RandomFaults(seed, lose=0.05, slow_down=0.02, fake_delete=0.25)
    proxy = FaultProxy(endpoint, faults)
    await proxy.start()
    kills: list[int] = []
    try:
        async with aws_clients(endpoint) as (s3, sqs):
            stack = await ensure_stack(s3, sqs, settings)
            await s3.put_bucket_versioning(
                Bucket="jobs", VersioningConfiguration={"Status": "Enabled"}
            )
            env = worker_env(
                await proxy.endpoint(0),
                ARBITER_WORKER_PROCESSES=processes,
                ARBITER_SHARD_LINES=shard_lines,
                ARBITER_MAX_LINE_BYTES=400,
                ARBITER_VISIBILITY_TIMEOUT_S=3,
                ARBITER_HEARTBEAT_S=1,
                ARBITER_FAKE_DELAY_S=engine_delay_s,
                ARBITER_CHUNK_DECISIONS=8,
                ARBITER_BACKOFF_BASE_S=0.5,
                ARBITER_BACKOFF_MAX_S=2,
                ARBITER_MAX_RESTARTS=10_000,
                ARBITER_RESTART_MAX_DELAY_S=0.5,
            )
            pool = Proc([sys.executable, "-m", "arbiter", "work"], env)
            try:
                await asyncio.to_thread(pool.wait_event, "worker.ready", processes)
                found = await _run_jobs(
                    s3, sqs, stack, settings, pool, rng, jobs, lines, kills, kill_every, timeout_s
                )
            finally:
                pool.popen.send_signal(signal.SIGTERM)
                try:
                    pool.popen.wait(60)
                except subprocess.TimeoutExpired:
                    pool.kill_all()
            bad, summaries = found
    finally:
        await proxy.close()
    counts = Counter({k: v for k, v in proxy.counts.items() if not k.startswith("dropped")})
    return {
        "jobs": jobs,
        "lines_per_job": lines,
        "shard_lines": shard_lines,
        "worker_processes": processes,
        "sigkills": len(kills),
        "worker_restarts": len(pool.events("pool.worker_started")) - processes,
        "faults": dict(sorted(counts.items())),
        "summaries": summaries,
        "violations": bad,
        "wall_s": round(time.monotonic() - started, 1),
    }


async def _run_jobs(
    s3: Any,
    sqs: Any,
    stack: dict[str, str],
    settings: WorkerSettings,
    pool: Proc,
    rng: random.Random,
    count: int,
    lines: int,
    kills: list[int],
    kill_every: tuple[float, float],
    timeout_s: float,
) -> tuple[list[str], list[dict[str, Any]]]:
    submit_env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_ACCESS_KEY_ID": "testing"}
    submit_env |= {
        "AWS_SECRET_ACCESS_KEY": "testing",
        "ARBITER_AWS_ENDPOINT_URL": settings.aws_endpoint_url or "",
    }
    submit_env |= {"ARBITER_BUCKET": "jobs"}
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, suffix in zip(range(count), [".jsonl", ".jsonl.gz", ".json"] * count, strict=False):
            path = Path(tmp) / f"blackbox-{i}{suffix}"
            path.write_bytes(job_body(job_lines(lines, run=1 + i), suffix))
            paths.append(path)
        killer = asyncio.create_task(_killer(pool, rng, kill_every, kills))
        try:
            summaries = await asyncio.gather(
                *(asyncio.to_thread(_submit, submit_env, p, timeout_s) for p in paths)
            )
            await wait_for(lambda: _drained(sqs, stack["queue_url"]), within_s=60)
        finally:
            killer.cancel()
        jobs = []
        for path, summary in zip(paths, summaries, strict=True):
            body = path.read_bytes()
            key = f"incoming/{path.name}"
            expected, numbers = await single_path_records(key, body, settings, FakeEngine())
            jobs.append(Job(key, summary["input"]["etag"], body, expected, numbers))
            assert (
                output_keys(settings, key, summary["input"]["etag"]).results
                == summary["results_key"]
            )
    bad = await violations(s3, sqs, stack, settings, jobs)
    brief = [
        {
            "lines": s["lines"],
            "ok": s["ok"],
            "failed": s["failed"],
            "shards": s.get("shards", {}).get("count"),
            "failed_shards": len(s.get("shards", {}).get("failed", [])),
        }
        for s in summaries
    ]
    return bad, brief


async def _drained(sqs: Any, url: str) -> bool:
    return not await pending(sqs, url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.worker.blackbox")
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--lines", type=int, default=240)
    parser.add_argument("--kill-every", type=float, nargs=2, default=(0.3, 1.2), metavar="S")
    args = parser.parse_args(argv)
    figures = asyncio.run(blackbox(args.seed, args.jobs, args.lines, kill_every=args.kill_every))
    print(json.dumps(figures, indent=1))
    return 1 if figures["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
