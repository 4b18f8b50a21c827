"""`arbiter local`: the whole stack on one machine.

A moto server on 127.0.0.1 stands in for S3 and SQS (unless ARBITER_AWS_ENDPOINT_URL names one),
the bucket, queue, dead-letter queue and S3 -> SQS notification are created, and `arbiter serve`,
`arbiter work` and `arbiter runtime` (the SageMaker Runtime API, port 8081) run as child processes
until Ctrl-C / SIGTERM, which they receive in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from worker.settings import WorkerSettings


def _start_moto(port: int) -> tuple[Any, str]:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SystemExit(
            "arbiter local needs moto's server: pip install 'arbiter[local]' (or set "
            "ARBITER_AWS_ENDPOINT_URL to an S3/SQS endpoint)"
        ) from exc
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    host, bound = server.get_host_and_port()
    return server, f"http://{host}:{bound}"


async def _provision(settings: WorkerSettings) -> dict[str, str]:
    from aiobotocore.session import get_session

    from worker.stack import ensure_stack

    session = get_session()
    async with (
        session.create_client("s3", **settings.client_kwargs()) as s3,
        session.create_client("sqs", **settings.client_kwargs()) as sqs,
    ):
        return await ensure_stack(s3, sqs, settings)


def run_local(args: argparse.Namespace) -> int:
    base = WorkerSettings()
    if not (args.no_serve and args.no_work):  # a missing model refused before anything starts
        from arbiter.engine import check_files
        from arbiter.settings import engine_from_environment

        check_files(engine_from_environment())
    server = None
    endpoint = base.aws_endpoint_url
    if not endpoint:
        server, endpoint = _start_moto(args.moto_port)
    env = {**os.environ, "ARBITER_AWS_ENDPOINT_URL": endpoint}
    if not env.get("AWS_ACCESS_KEY_ID"):
        env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    if args.processes:
        env["ARBITER_WORKER_PROCESSES"] = str(args.processes)
    settings = base.model_copy(update={"aws_endpoint_url": endpoint})
    stack = asyncio.run(_provision(settings))

    children = _spawn(args, env)
    print(
        f"arbiter local is up\n"
        f"  S3 + SQS endpoint: {endpoint}\n"
        f"  bucket:            s3://{settings.bucket}/{settings.input_prefix} -> "
        f"{settings.output_prefix}\n"
        f"  queue:             {stack['queue_url']} (dead letters: {stack['dlq_url']})\n"
        f"submit a job from another shell:\n"
        f"  ARBITER_AWS_ENDPOINT_URL={endpoint} arbiter submit examples/job.jsonl\n"
        f"Ctrl-C stops everything.",
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.submit is not None:
        asyncio.run(_demo(settings, args.submit))
    while not stop.wait(0.5):
        if children and all(c.poll() is not None for c in children):
            break
    status = _stop(children, settings.drain_deadline_s + 20)
    if server is not None:
        server.stop()
    return status


async def _demo(settings: WorkerSettings, path: Any) -> None:
    """Submit a job the way `arbiter submit` does and show what came back."""
    from aiobotocore.session import get_session

    from worker.submit import submit

    summary = await submit(settings, path, timeout_s=900)
    if summary is None:
        print("the example job did not finish in 15 minutes", flush=True)
        return
    if "rejected" in summary:
        print(f"the job was rejected: {summary['rejected']}", flush=True)
        return
    brief = {k: summary[k] for k in ("lines", "ok", "failed", "errors_by_code", "seconds")}
    print(f"job summary: {json.dumps(brief)}", flush=True)
    async with get_session().create_client("s3", **settings.client_kwargs()) as s3:
        got = await s3.get_object(Bucket=settings.bucket, Key=summary["results_key"])
        async with got["Body"] as body:
            lines = (await body.read()).decode().splitlines()
    print(f"first results of {len(lines)} (s3://{settings.bucket}/{summary['results_key']}):")
    for line in lines[:5]:
        record = json.loads(line)
        outcome = record.get("result") or record.get("error")
        brief = (
            {
                "choice": outcome["choice"],
                "probabilities": [round(p, 3) for p in outcome["probabilities"]],
            }
            if "result" in record
            else {"error": outcome["code"]}
        )
        print(f"  line {record['line']} {record['id']}: {json.dumps(brief)}", flush=True)
    print("the stack keeps running (curl localhost:8080/ping); Ctrl-C stops it.", flush=True)


def _spawn(args: argparse.Namespace, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    children: list[subprocess.Popen[bytes]] = []
    if not args.no_serve:
        if importlib.util.find_spec("adapter.app") is None:
            print("note: `arbiter serve` is not available in this build; not started", flush=True)
        else:
            children.append(subprocess.Popen([sys.executable, "-m", "arbiter", "serve"], env=env))
    if not args.no_work:
        children.append(subprocess.Popen([sys.executable, "-m", "arbiter", "work"], env=env))
    if not getattr(args, "no_runtime", False):  # the SageMaker Runtime API; it prints its URL
        children.append(subprocess.Popen([sys.executable, "-m", "arbiter", "runtime"], env=env))
    return children


def _stop(children: list[subprocess.Popen[bytes]], timeout_s: float) -> int:
    """SIGTERM to each child, then wait (they drain); 1 if one had to be killed."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    status = 0
    for child in children:
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            status = 1
    return status
