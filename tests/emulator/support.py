"""The local SageMaker runtime under test: a container (the real adapter, or a stand-in that
misbehaves on purpose), the front in front of it, moto for S3 and SNS, and boto3's real clients."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import boto3
from aiohttp import web
from botocore.config import Config

from adapter.app import create_app as create_container
from arbiter.engine import Engine
from arbiter.settings import ServerSettings
from emulator.app import create_app as create_front
from emulator.settings import RuntimeSettings
from tests.aws import CREDS
from tests.live_server import serve

BUCKET = "arbiter-jobs"


@contextlib.contextmanager
def container(
    engine: Any,
    ready_path: str = "/ping",
    factory: Callable[[], Any] | None = None,
    **settings: Any,
) -> Iterator[str]:
    """The real adapter over ``engine`` (the session's real one is not closed after), on loopback."""
    server = ServerSettings(**{"max_in_flight": 1, "max_queue": 8, **settings})
    app = create_container(
        server, factory or (lambda: engine), close_engine=not isinstance(engine, Engine)
    )
    with serve(app, ready_path=ready_path) as url:
        yield url


@contextlib.contextmanager
def front(
    container_url: str, moto: str, clock: Callable[[], float] | None = None, **kw: Any
) -> Iterator[str]:
    settings = RuntimeSettings(
        container_url=container_url, aws_endpoint_url=moto, port=0, drain_s=0, **kw
    )
    app = create_front(settings, clock=clock) if clock else create_front(settings)
    with serve(app, ready_path="/metrics") as url:
        yield url


OPEN_CLIENTS: list[Any] = []  # closed after each test (tests/emulator/conftest.py)


def runtime(url: str, **config: Any) -> Any:
    """boto3's sagemaker-runtime client, as an application builds it, pointed at ``url``."""
    client = boto3.client(
        "sagemaker-runtime",
        endpoint_url=url,
        region_name="us-east-1",
        config=Config(**config) if config else None,
        **CREDS,
    )
    OPEN_CLIENTS.append(client)
    return client


def aws(service: str, moto: str) -> Any:
    client = boto3.client(service, endpoint_url=moto, region_name="us-east-1", **CREDS)
    OPEN_CLIENTS.append(client)
    return client


def make_bucket(moto: str) -> Any:
    s3 = aws("s3", moto)
    s3.create_bucket(Bucket=BUCKET)
    return s3


def subscribe(moto: str) -> dict[str, str]:
    """An SQS queue on each of the template's async topics (they exist once the front is up):
    {"success": queue url, "error": queue url}."""
    sns, sqs = aws("sns", moto), aws("sqs", moto)
    queues = {}
    for topic in sns.list_topics()["Topics"]:
        arn = topic["TopicArn"]
        kind = "success" if arn.endswith("AsyncSuccessTopic") else "error"
        url = sqs.create_queue(QueueName=f"notified-{kind}")["QueueUrl"]
        queue_arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])[
            "Attributes"
        ]["QueueArn"]
        sns.subscribe(
            TopicArn=arn,
            Protocol="sqs",
            Endpoint=queue_arn,
            Attributes={"RawMessageDelivery": "true"},
        )
        queues[kind] = url
    return queues


def notifications(moto: str, url: str, want: int = 1, wait_s: int = 20) -> list[dict[str, Any]]:
    sqs = aws("sqs", moto)
    found: list[dict[str, Any]] = []
    for _ in range(wait_s):
        got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1)
        found += [json.loads(m["Body"]) for m in got.get("Messages", [])]
        if len(found) >= want:
            break
    return found


class StandIn:
    """A container that answers what the test tells it: ``respond`` is an aiohttp handler (run on
    the server's own loop, in its thread); it records what it was sent and how many requests it
    held at once."""

    def __init__(self) -> None:
        self.respond: Callable[[web.Request], Any] = self._ok
        self.ping: Callable[[web.Request], Any] = self._pong
        self.seen: list[dict[str, Any]] = []
        self.execution: dict[str, Any] | None = None
        self.active = 0
        self.most_active = 0

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _pong(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def app(self) -> web.Application:
        async def ping(request: web.Request) -> web.StreamResponse:
            result: web.StreamResponse = await self.ping(request)
            return result

        async def invocations(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            self.seen.append({"headers": dict(request.headers), "body": body})
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            try:
                result: web.StreamResponse = await self.respond(request)
            finally:
                self.active -= 1
            return result

        async def execution(request: web.Request) -> web.Response:
            if self.execution is None:
                raise web.HTTPNotFound()
            return web.json_response(self.execution)

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/ping", ping)
        app.router.add_get("/execution-parameters", execution)
        app.router.add_post("/invocations", invocations)
        return app


@contextlib.contextmanager
def stand_in(port: int = 0, fake: StandIn | None = None) -> Iterator[tuple[StandIn, str]]:
    fake = fake or StandIn()
    with serve(fake.app(), port=port) as url:
        yield fake, url


@contextlib.contextmanager
def proxy(moto: str, decide: Callable[[Any], str]) -> Iterator[str]:
    """The fault proxy (``tests.faults.proxy``) in front of moto, on a loop of its own: yields the
    endpoint URL to give the front (its S3, SNS and SQS calls all pass through ``decide``)."""
    import asyncio
    import threading

    from tests.faults.proxy import FaultProxy

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fault-proxy", daemon=True)
    thread.start()
    faulty = FaultProxy(moto, decide)

    async def start() -> str:
        await faulty.start()
        return await faulty.endpoint(1)

    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    finally:
        asyncio.run_coroutine_threadsafe(faulty.close(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def poll_object(s3: Any, location: str, within_s: float = 60) -> bytes:
    """What an application does: poll an S3 location until the object is there."""
    import time

    from botocore.exceptions import ClientError

    bucket, _, key = location[5:].partition("/")
    deadline = time.monotonic() + within_s
    while True:
        try:
            data: bytes = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            return data
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "NoSuchKey" or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def exists(s3: Any, location: str) -> bool:
    bucket, _, key = location[5:].partition("/")
    return bool(s3.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount"))


@contextlib.contextmanager
def runtime_process(env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """`arbiter runtime` as a process of its own, its output lines collected."""
    process = subprocess.Popen(
        [sys.executable, "-m", "arbiter", "runtime"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    assert process.stdout is not None
    out = process.stdout
    reader = threading.Thread(target=lambda: lines.extend(iter(out.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any(line.startswith("SageMaker runtime API: ") for line in list(lines)):
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        yield process, lines
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        reader.join(timeout=10)
        out.close()
