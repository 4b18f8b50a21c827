"""`arbiter bench worker`: a job's decisions/s end to end through the local stack vs the engine
alone on the same decisions in the same run, and grouped vs ungrouped scoring.

1. The job: ``--decisions`` decisions, 10 questions over each state of ``--state-tokens`` (~400)
   tokens (100 states for the default 1,000), written as a JSONL job file.
2. Engine alone: the same decisions through ``Engine.score`` in the worker's chunks (grouped by
   state, prefix cache cleared first), in this process.
3. Ungrouped: the first ``--ungrouped`` of them scored one call each, prefix cache cleared before
   each, so every decision prefills its whole prompt.
4. End to end: a moto server on 127.0.0.1, the bucket/queue/DLQ/notification, one `arbiter work`
   process (same thread count), and the job dropped into the input prefix; timed from the
   PutObject to the summary's appearance (the model load happens before, as in a running pool).
The engine is closed before step 4, so the two paths never compete for the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from adapter.settings import EngineSettings

QUESTIONS = [
    "Which queue should handle this case?",
    "Which team owns the follow-up?",
    "What is the most likely root cause?",
    "Where should the customer be routed?",
    "Which specialist should review it first?",
    "What kind of problem is described?",
    "Which department is responsible?",
    "Which category fits the case best?",
    "What should happen next?",
    "Who should be told first?",
]
ROOT = Path(__file__).resolve().parent.parent


def build_job(engine: Any, n: int, state_tokens: int) -> list[Any]:
    from bench.engine_bench import _decision, _sized_state

    decisions = []
    for s in range(-(-n // len(QUESTIONS))):
        state = _sized_state(engine, 500_000 + s, state_tokens, whole_prompt=False)
        for q, question in enumerate(QUESTIONS):
            if len(decisions) < n:
                d = _decision(0, state, question)
                decisions.append(d.model_copy(update={"id": f"s{s}-q{q}"}))
    return decisions


def engine_path(engine: Any, decisions: list[Any], chunk: int) -> float:
    engine.cache.clear()
    started = time.perf_counter()
    for start in range(0, len(decisions), chunk):
        for outcome in engine.score(decisions[start : start + chunk]):
            assert not isinstance(outcome, Exception), outcome
    return time.perf_counter() - started


def ungrouped_path(engine: Any, decisions: list[Any]) -> float:
    elapsed = 0.0
    for d in decisions:
        engine.cache.clear()
        started = time.perf_counter()
        [outcome] = engine.score([d])
        elapsed += time.perf_counter() - started
        assert not isinstance(outcome, Exception), outcome
    return elapsed


def _start_worker(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "adapter.cli", "work"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


async def end_to_end(job: bytes, n_threads: int, chunk: int) -> tuple[float, dict[str, Any]]:
    import logging

    from aiobotocore.session import get_session
    from moto.server import ThreadedMotoServer

    from worker.jobs import output_keys
    from worker.settings import WorkerSettings
    from worker.stack import ensure_stack

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    settings = WorkerSettings(aws_endpoint_url=endpoint, bucket="bench", chunk_decisions=chunk)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_")}
    env.update(
        ARBITER_AWS_ENDPOINT_URL=endpoint,
        ARBITER_BUCKET="bench",
        ARBITER_WAIT_TIME_S="1",
        ARBITER_METRICS_PORT="0",
        ARBITER_WORKER_PROCESSES="1",
        ARBITER_WORKER_THREADS=str(n_threads),
        ARBITER_CHUNK_DECISIONS=str(chunk),
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
    )
    worker = _start_worker(env)
    ready = threading.Event()

    def watch() -> None:
        assert worker.stderr is not None
        for line in worker.stderr:
            if '"worker.ready"' in line:
                ready.set()

    threading.Thread(target=watch, daemon=True).start()
    session = get_session()
    kw = {"region_name": "us-east-1", "endpoint_url": endpoint}
    kw.update(aws_access_key_id="testing", aws_secret_access_key="testing")
    try:
        async with (
            session.create_client("s3", **kw) as s3,
            session.create_client("sqs", **kw) as sqs,
        ):
            await ensure_stack(s3, sqs, settings)
            if not await asyncio.to_thread(ready.wait, 120):
                raise RuntimeError("the worker did not become ready")
            started = time.perf_counter()
            put = await s3.put_object(Bucket="bench", Key="incoming/bench.jsonl", Body=job)
            keys = output_keys(settings, "incoming/bench.jsonl", put["ETag"].strip('"'))
            while True:
                try:
                    got = await s3.get_object(Bucket="bench", Key=keys.summary)
                    break
                except s3.exceptions.NoSuchKey:
                    await asyncio.sleep(0.1)
            elapsed = time.perf_counter() - started
            async with got["Body"] as body:
                summary: dict[str, Any] = json.loads(await body.read())
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        if worker.stderr is not None:
            worker.stderr.close()
        server.stop()
    return elapsed, summary


def main(args: argparse.Namespace) -> int:
    from adapter.engine import open_engine

    settings = EngineSettings()
    threads = settings.n_threads
    engine = open_engine(settings, model=args.model)
    chunk = 256
    decisions = build_job(engine, args.decisions, args.state_tokens)
    job = "".join(d.model_dump_json(exclude_none=True) + "\n" for d in decisions).encode()
    n = len(decisions)
    print(
        f"job: {n} decisions, {-(-n // 10)} states x 10 questions, {len(job)} bytes",
        file=sys.stderr,
    )

    engine_s = engine_path(engine, decisions, chunk)
    print(f"engine alone: {engine_s:.1f} s", file=sys.stderr)
    m = min(args.ungrouped, n)
    ungrouped_s = ungrouped_path(engine, decisions[:m])
    print(f"ungrouped ({m}): {ungrouped_s:.1f} s", file=sys.stderr)
    engine.close()

    e2e_s, summary = asyncio.run(end_to_end(job, threads, chunk))
    print(f"end to end: {e2e_s:.1f} s", file=sys.stderr)
    assert summary["lines"] == n and summary["ok"] == n, summary

    engine_rate = n / engine_s
    e2e_rate = n / e2e_s
    ungrouped_rate = m / ungrouped_s
    report = {
        "decisions": n,
        "states": -(-n // 10),
        "state_tokens": args.state_tokens,
        "threads": threads,
        "engine_decisions_per_s": round(engine_rate, 2),
        "end_to_end_decisions_per_s": round(e2e_rate, 2),
        "end_to_end_vs_engine": round(e2e_rate / engine_rate, 3),
        "worker_engine_s": summary["seconds"]["engine"],
        "ungrouped_decisions": m,
        "ungrouped_decisions_per_s": round(ungrouped_rate, 2),
        "grouped_vs_ungrouped": round(engine_rate / ungrouped_rate, 2),
        "targets": {"end_to_end_vs_engine": ">= 0.90", "grouped_vs_ungrouped": ">= 4"},
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"decisions/s  engine alone {engine_rate:.2f}  end to end {e2e_rate:.2f}  "
            f"ratio {report['end_to_end_vs_engine']:.3f} (target >= 0.90)\n"
            f"decisions/s  grouped {engine_rate:.2f}  ungrouped {ungrouped_rate:.2f}  "
            f"ratio {report['grouped_vs_ungrouped']:.2f}x (target >= 4x)"
        )
    return 0
