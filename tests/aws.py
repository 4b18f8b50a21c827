"""S3 and SQS for the tests: one moto server per session (on 127.0.0.1, reset per test by the
``endpoint`` fixture), clients as the worker builds them, and small readers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

CREDS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def _atomic_object_writes() -> None:
    """moto checks a write's condition (``If-None-Match``, ``If-Match``) and then stores the object
    in two steps, with nothing that stops another of its server threads in between; S3 does both
    as one (that is what a conditional write is). Object writes (PUT and POST on a key: PutObject,
    UploadPart(Copy), CompleteMultipartUpload) are serialized here, so that the test server keeps
    the guarantee that the fan-out (worker/fanout/) relies on and races between workers are S3's, not moto's."""
    from moto.s3.responses import S3Response

    if getattr(S3Response, "_arbiter_atomic", False):
        return
    lock = threading.Lock()
    for name in ("_key_response_put", "_key_response_post"):
        original = getattr(S3Response, name)

        def locked(self: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
            with lock:
                return _original(self, *args, **kw)

        setattr(S3Response, name, locked)
    S3Response._arbiter_atomic = True  # type: ignore[attr-defined]


@functools.cache
def moto_endpoint() -> str:
    """Start moto's threaded server once for the session (stopped at exit with the process)."""
    from moto.server import ThreadedMotoServer

    _atomic_object_writes()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    import atexit

    atexit.register(server.stop)
    return f"http://{host}:{port}"


def reset_moto(endpoint: str) -> None:
    request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


async def wait_for(predicate: Any, within_s: float = 30.0, interval: float = 0.2) -> Any:
    """Poll an async predicate until it returns something truthy."""
    deadline = time.monotonic() + within_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def aws_clients(endpoint: str) -> AsyncIterator[tuple[Any, Any]]:
    """aiobotocore S3 and SQS clients on the moto endpoint, as the worker builds them."""
    from aiobotocore.session import get_session

    session = get_session()
    kw = {"region_name": "us-east-1", "endpoint_url": endpoint, **CREDS}
    async with (
        session.create_client("s3", **kw) as s3,
        session.create_client("sqs", **kw) as sqs,
    ):
        yield s3, sqs


async def read_object(s3: Any, bucket: str, key: str) -> bytes:
    got = await s3.get_object(Bucket=bucket, Key=key)
    async with got["Body"] as body:
        data: bytes = await body.read()
    return data


async def list_keys(s3: Any, bucket: str, prefix: str = "") -> list[str]:
    got = await s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in got.get("Contents", []))


async def receive_all(sqs: Any, url: str, wait: int = 0) -> list[dict[str, Any]]:
    got = await sqs.receive_message(
        QueueUrl=url,
        MaxNumberOfMessages=10,
        WaitTimeSeconds=wait,
        MessageSystemAttributeNames=["ApproximateReceiveCount"],
    )
    return list(got.get("Messages", []))


async def queue_counts(sqs: Any, url: str) -> tuple[int, int]:
    """(visible, in flight) messages."""
    got = await sqs.get_queue_attributes(
        QueueUrl=url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )
    a = got["Attributes"]
    return int(a["ApproximateNumberOfMessages"]), int(a["ApproximateNumberOfMessagesNotVisible"])


async def s3_notification(sqs: Any, url: str) -> dict[str, Any]:
    """The next S3 notification on the queue (S3's test event is deleted on the way)."""
    for _ in range(10):
        for message in await receive_all(sqs, url, wait=1):
            if "Records" in message["Body"]:
                return message
            await sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
    raise AssertionError("no S3 notification arrived")
