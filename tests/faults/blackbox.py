"""The black-box run, tried as a new user would: `arbiter work` (a pool of worker processes) and
`arbiter submit`, on a local S3/SQS endpoint, with a loopback proxy in front of the endpoint that
loses the answers of committed writes, answers SQS deletes without deleting and refuses requests
with 503 SlowDown, while worker processes are SIGKILLed at random (the pool restarts them). Every
job must finish with every line once, in order, the single path's records, a true summary, a
finished status, nothing left behind, no ``shard_failed`` line and an empty DLQ.

Four scenarios (``make faults`` runs them all):

- ``faults``: three 240-line jobs in shards of 40 under random faults and kills;
- ``outage``: three 120-line jobs in shards of 8 under the same, and from 15 s after the jobs are
  dropped, 150 s in which every S3 request is answered 503 SlowDown (a store outage: no good line
  may turn into ``shard_failed``, no message may reach the DLQ);
- ``sqs-flap`` (issue 36): the same jobs, shards that take longer than two heartbeats (2.4 s
  against 1 s), and from 15 s, SQS answering every request 503 for 8 s of every 14 s for 3
  minutes (a flapping NAT gateway or VPC endpoint): leases are lost, copies and deletes refused;
- ``partial`` (issue 36): the same jobs, and from 15 s, 150 s in which every GET of a shard input
  is answered 503 while the probe's LIST (and every other request) works: a partial outage the
  breaker's probe does not see.

    python -m tests.faults.blackbox                       # the faults scenario; figures as JSON
    python -m tests.faults.blackbox --scenario outage     # the store outage
    python -m tests.faults.blackbox --scenario sqs-flap   # SQS down 8 s of every 14 s
    python -m tests.faults.blackbox --scenario partial    # shard inputs' GETs down, LIST up
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests import ROOT
from tests.aws import aws_clients, moto_endpoint, receive_all, reset_moto, wait_for
from tests.fakes import FakeEngine
from tests.faults.invariants import Job, single_path_records, violations
from tests.faults.proxy import Call, FaultProxy
from tests.worker.fanout_support import job_body, job_lines, pending
from tests.worker.test_pool import Proc, worker_env
from worker.outputs import output_keys
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


class Outage:
    """Every request that ``hits`` answered 503 from ``start_s`` after :meth:`begin` for
    ``length_s`` (by default every S3 request: an outage of the store); with ``flap``, (down,
    up) seconds, only while down within that time (an outage that comes and goes); any other
    request as ``inner`` decides."""

    def __init__(
        self,
        inner: Callable[[Call], str],
        start_s: float,
        length_s: float,
        hits: Callable[[Call], bool] = lambda call: call.service == "s3",
        flap: tuple[float, float] | None = None,
    ) -> None:
        self.inner, self.start_s, self.length_s = inner, start_s, length_s
        self.hits, self.flap = hits, flap
        self.began: float | None = None
        self.refused = 0

    def begin(self) -> None:
        self.began = time.monotonic()

    def down(self) -> bool:
        if self.began is None:
            return False
        since = time.monotonic() - self.began - self.start_s
        if not 0 <= since < self.length_s:
            return False
        return self.flap is None or since % sum(self.flap) < self.flap[0]

    def __call__(self, call: Call) -> str:
        if self.hits(call) and self.down():
            self.refused += 1
            return "fail_503"
        return self.inner(call)


HITS: dict[str, Callable[[Call], bool]] = {
    "s3": lambda call: call.service == "s3",
    "sqs": lambda call: call.service == "sqs",
    "shard-inputs": lambda call: call.op == "GetObject" and "/in/" in call.key,
}


def _live_workers(pool: Proc) -> dict[int, int]:
    """Worker slot -> pid of its latest process that is ready (a process killed while it still
    imports exercises nothing but the restart, and under load it would be all a killer hits)."""
    live: dict[int, int] = {}
    for event in pool.events("worker.ready"):
        live[int(event["worker"])] = int(event["pid"])
    return live


class Counted:
    """Counts the requests the workers send (``decide`` answers each)."""

    def __init__(self, decide: Callable[[Call], str]) -> None:
        self.decide, self.calls = decide, 0

    def __call__(self, call: Call) -> str:
        self.calls += 1
        return self.decide(call)


async def _killer(
    pool: Proc,
    rng: random.Random,
    every: tuple[float, float],
    kills: list[int],
    requests: Counted,
    per_kill: int,
) -> None:
    """SIGKILL a random ready worker every ``every`` seconds, once the workers sent ``per_kill``
    requests since the last kill: the kills per unit of work stay the same however loaded the
    machine is (on a loaded one a killer on the clock alone kills every worker before it does
    anything)."""
    since = requests.calls
    while True:
        await asyncio.sleep(rng.uniform(*every))
        live = _live_workers(pool)
        if live and requests.calls - since >= per_kill:
            pid = rng.choice(sorted(live.values()))
            try:
                os.kill(pid, signal.SIGKILL)
                kills.append(pid)
                since = requests.calls
            except ProcessLookupError:
                pass


def _submit(env: dict[str, str], path: Path, timeout_s: float) -> dict[str, Any] | None:
    """The job's summary; None if none came within ``timeout_s``."""
    done = subprocess.run(
        [sys.executable, "-m", "arbiter", "submit", str(path), "--timeout", str(timeout_s)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
        check=False,
    )
    if done.returncode != 0 and "no summary after" in done.stderr:
        return None
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
    outage: tuple[float, float] | None = None,
    requests_per_kill: int = 50,
    hits: str = "s3",
    flap: tuple[float, float] | None = None,
    chunk_decisions: int = 8,
) -> dict[str, Any]:
    """One black-box run (see the module doc); its figures, and what did not hold. ``outage``:
    (start, length) in seconds of an outage of what ``hits`` names (:data:`HITS`), counted from the
    jobs' drop, coming and going by ``flap`` (down, up) if given."""
    started = time.monotonic()
    endpoint = moto_endpoint()
    reset_moto(endpoint)
    rng = random.Random(seed)
    settings = WorkerSettings(aws_endpoint_url=endpoint, bucket="jobs", max_line_bytes=400)
    faults = RandomFaults(seed, lose=0.05, slow_down=0.02, fake_delete=0.25)
    store = Outage(faults, *outage, HITS[hits], flap) if outage else None
    requests = Counted(store or faults)
    proxy = FaultProxy(endpoint, requests)
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
                ARBITER_CHUNK_DECISIONS=chunk_decisions,
                ARBITER_BACKOFF_BASE_S=0.5,
                ARBITER_BACKOFF_MAX_S=2,
                ARBITER_MAX_RESTARTS=10_000,
                ARBITER_RESTART_MAX_DELAY_S=0.5,
            )
            pool = Proc([sys.executable, "-m", "arbiter", "work"], env)
            try:
                await asyncio.to_thread(pool.wait_event, "worker.ready", processes)
                if store is not None:
                    store.begin()
                killer = asyncio.create_task(
                    _killer(pool, rng, kill_every, kills, requests, requests_per_kill)
                )
                try:
                    found = await _run_jobs(s3, sqs, stack, settings, jobs, lines, timeout_s)
                finally:
                    killer.cancel()
                alive = pool.popen.poll() is None  # the pool lived through it all
            finally:
                pool.popen.send_signal(signal.SIGTERM)
                try:
                    pool.popen.wait(60)
                except subprocess.TimeoutExpired:
                    pool.kill_all()
            bad, summaries = found
            if not alive:
                bad.append(f"the pool exited {pool.popen.returncode} before the jobs ended")
            if bad:
                log = Path(tempfile.gettempdir()) / f"blackbox-{seed}-{os.getpid()}.log"
                log.write_text("\n".join(pool.lines) + "\n")
                bad.append(f"the workers' log: {log}")
    finally:
        await proxy.close()
    counts = Counter({k: v for k, v in proxy.counts.items() if not k.startswith("dropped")})
    return {
        "jobs": jobs,
        "lines_per_job": lines,
        "shard_lines": shard_lines,
        "worker_processes": processes,
        "sigkills": len(kills),
        "requests": requests.calls,
        "worker_restarts": len(pool.events("pool.worker_started")) - processes,
        "workers_ready": len(pool.events("worker.ready")),
        "store_unavailable": len(pool.events("store.unavailable")),
        "outage_retries": len(pool.events("message.outage")),
        "faults": dict(sorted(counts.items())),
        "outage": {
            "start_s": outage[0],
            "length_s": outage[1],
            "hits": hits,
            "flap": flap,
            "refused": store.refused,
        }
        if outage and store
        else None,
        "leases_lost": len(pool.events("visibility.lost")),
        "receives_uncounted": len(pool.events("receive.uncounted")),
        "queue_unavailable": len(pool.events("queue.unavailable")),
        "pool_exit": pool.popen.returncode,
        "summaries": summaries,
        "violations": bad,
        "wall_s": round(time.monotonic() - started, 1),
    }


async def _run_jobs(
    s3: Any,
    sqs: Any,
    stack: dict[str, str],
    settings: WorkerSettings,
    count: int,
    lines: int,
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
        summaries = await asyncio.gather(
            *(asyncio.to_thread(_submit, submit_env, p, timeout_s) for p in paths)
        )
        if None not in summaries:
            await wait_for(lambda: _drained(sqs, stack["queue_url"]), within_s=60)
        if None in summaries:
            return await _unfinished(sqs, stack, paths, summaries, timeout_s), []
        done = [s for s in summaries if s is not None]
        jobs = []
        for path, summary in zip(paths, done, strict=True):
            body = path.read_bytes()
            key = f"incoming/{path.name}"
            expected, numbers = await single_path_records(key, body, settings, FakeEngine())
            jobs.append(Job(key, summary["input"]["etag"], body, expected, numbers))
            assert (
                output_keys(settings, key, summary["input"]["etag"]).results
                == summary["results_key"]
            )
    bad = await violations(s3, sqs, stack, settings, jobs)
    for path, summary in zip(paths, done, strict=True):
        lost = summary["errors_by_code"].get("shard_failed", 0)
        if lost or summary.get("shards", {}).get("failed"):
            bad.append(f"{path.name}: {lost} lines shard_failed (every shard could be scored)")
    brief = [
        {
            "lines": s["lines"],
            "ok": s["ok"],
            "failed": s["failed"],
            "shards": s.get("shards", {}).get("count"),
            "failed_shards": len(s.get("shards", {}).get("failed", [])),
        }
        for s in done
    ]
    return bad, brief


async def _unfinished(
    sqs: Any,
    stack: dict[str, str],
    paths: list[Path],
    summaries: list[dict[str, Any] | None],
    timeout_s: float,
) -> list[str]:
    """What a run whose jobs did not all finish left: the jobs, and the DLQ's messages."""
    bad = [
        f"{path.name}: no summary within {timeout_s:.0f} s"
        for path, summary in zip(paths, summaries, strict=True)
        if summary is None
    ]
    dead = await receive_all(sqs, stack["dlq_url"], wait=1)
    bad += [f"the DLQ holds {m['Body'][:200]}" for m in dead]
    return bad


async def _drained(sqs: Any, url: str) -> bool:
    return not await pending(sqs, url)


SCENARIOS: dict[str, dict[str, Any]] = {
    "faults": {"lines": 240, "shard_lines": 40},
    "outage": {"lines": 120, "shard_lines": 8, "outage": (15.0, 150.0), "timeout_s": 600},
    "sqs-flap": {
        "lines": 120,
        "shard_lines": 8,
        "outage": (15.0, 180.0),
        "hits": "sqs",
        "flap": (8.0, 6.0),
        "chunk_decisions": 2,
        "engine_delay_s": 0.6,  # 4 calls of 0.6 s: a shard takes 2.4 s, heartbeats are 1 s
        "timeout_s": 600,
    },
    "partial": {
        "lines": 120,
        "shard_lines": 8,
        "outage": (15.0, 150.0),
        "hits": "shard-inputs",
        "timeout_s": 600,
    },
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.blackbox")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="faults")
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--lines", type=int, default=None, help="lines per job")
    parser.add_argument("--shard-lines", type=int, default=None)
    parser.add_argument("--outage", type=float, nargs=2, default=None, metavar=("START", "LENGTH"))
    parser.add_argument("--kill-every", type=float, nargs=2, default=(0.3, 1.2), metavar="S")
    parser.add_argument("--requests-per-kill", type=int, default=50)
    args = parser.parse_args(argv)
    chosen = dict(SCENARIOS[args.scenario])
    for name in ("lines", "shard_lines", "outage"):
        if getattr(args, name) is not None:
            chosen[name] = getattr(args, name)
    figures = asyncio.run(
        blackbox(
            args.seed,
            args.jobs,
            kill_every=tuple(args.kill_every),
            requests_per_kill=args.requests_per_kill,
            **chosen,
        )
    )
    print(json.dumps(figures, indent=1))
    return 1 if figures["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
