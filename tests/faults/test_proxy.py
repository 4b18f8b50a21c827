"""The fault proxy does what it says, through the real aiobotocore client: a lost response is resent
by botocore, a refused request is retried, a faked delete brings the message back, a duplicated send
is two messages, a killed worker's requests never arrive."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.aws import CREDS, aws_clients, read_object, receive_all
from tests.faults.proxy import Call, FaultProxy


class Script:
    """Act on the first call of an operation (and only that one)."""

    def __init__(self) -> None:
        self.once: dict[str, str] = {}

    def __call__(self, call: Call) -> str:
        return self.once.pop(call.op, "forward")


@contextlib.asynccontextmanager
async def proxied(endpoint: str) -> AsyncIterator[tuple[FaultProxy, Script]]:
    """A proxy in front of moto, driven by a script (built in the test's own event loop)."""
    script = Script()
    proxy = FaultProxy(endpoint, script)
    await proxy.start()
    try:
        yield proxy, script
    finally:
        await proxy.close()


def _clients(url: str, **config: Any) -> Any:
    from aiobotocore.session import get_session

    kw = {"region_name": "us-east-1", "endpoint_url": url, **CREDS}
    if config:
        kw["config"] = Config(**config)
    session = get_session()
    return session.create_client("s3", **kw), session.create_client("sqs", **kw)


async def test_a_lost_response_of_a_committed_conditional_put_is_resent_and_meets_itself(
    endpoint: str,
) -> None:
    async with proxied(endpoint) as (proxy, script):
        s3c, sqsc = _clients(await proxy.endpoint(1))
        async with s3c as s3, sqsc:
            await s3.create_bucket(Bucket="jobs")
            script.once["PutObject"] = "lose_response"
            with pytest.raises(ClientError) as lost:
                await s3.put_object(Bucket="jobs", Key="marker", Body=b"mine", IfNoneMatch="*")
            body = await read_object(s3, "jobs", "marker")
        # botocore sent it again after the reset, and the resend met the first (committed) copy.
        assert lost.value.response["Error"]["Code"] == "PreconditionFailed"
        assert body == b"mine" and proxy.counts["lose_response"] == 1


async def test_a_slow_down_is_retried_by_botocore(endpoint: str) -> None:
    async with proxied(endpoint) as (proxy, script):
        s3c, sqsc = _clients(await proxy.endpoint(1))
        async with s3c as s3, sqsc as sqs:
            await s3.create_bucket(Bucket="jobs")
            script.once["PutObject"] = "fail_503"
            put = await s3.put_object(Bucket="jobs", Key="k", Body=b"x")
            url = (await sqs.create_queue(QueueName="q"))["QueueUrl"]
            script.once["SendMessage"] = "fail_500"
            sent = await sqs.send_message(QueueUrl=url, MessageBody="m")
            got = await receive_all(sqs, url)
        assert put["ResponseMetadata"]["RetryAttempts"] == 1
        assert sent["ResponseMetadata"]["RetryAttempts"] == 1
        assert [m["Body"] for m in got] == ["m"]


async def test_a_faked_delete_brings_the_message_back_and_a_duplicated_send_is_two(
    endpoint: str,
) -> None:
    async with proxied(endpoint) as (proxy, script):
        s3c, sqsc = _clients(await proxy.endpoint(1))
        async with s3c, sqsc as sqs:
            url = (await sqs.create_queue(QueueName="q"))["QueueUrl"]
            script.once["SendMessage"] = "duplicate"
            await sqs.send_message(QueueUrl=url, MessageBody="twice")
            first = await sqs.receive_message(
                QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=1
            )
            assert [m["Body"] for m in first["Messages"]] == ["twice", "twice"]
            script.once["DeleteMessageBatch"] = "fake_delete"
            entries = [
                {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                for i, m in enumerate(first["Messages"])
            ]
            answer = await sqs.delete_message_batch(QueueUrl=url, Entries=entries)
            assert len(answer["Successful"]) == 2 and not answer.get("Failed")
            await asyncio.sleep(1.2)
            again = await receive_all(sqs, url, wait=1)
        assert [m["Body"] for m in again] == ["twice", "twice"]
        assert proxy.held_by(1) is not None


async def test_a_killed_worker_reaches_nothing_from_then_on(endpoint: str) -> None:
    async with proxied(endpoint) as (proxy, script):
        kw = {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 2}
        s3c, sqsc = _clients(await proxy.endpoint(1), **kw)
        async with aws_clients(endpoint) as (direct, _), s3c as s3, sqsc:
            await direct.create_bucket(Bucket="jobs")
            script.once["PutObject"] = "kill_after"
            with pytest.raises(Exception):  # noqa: B017 - a reset, whatever botocore names it
                await s3.put_object(Bucket="jobs", Key="committed", Body=b"x")
            with pytest.raises(Exception):  # noqa: B017
                await s3.put_object(Bucket="jobs", Key="never", Body=b"x")
            keys = [
                o["Key"] for o in (await direct.list_objects_v2(Bucket="jobs")).get("Contents", [])
            ]
        assert keys == ["committed"] and proxy.dead(1)
        assert proxy.counts["dropped_dead"] >= 2


async def test_a_role_without_list_bucket_sees_403_for_a_missing_key(endpoint: str) -> None:
    async with proxied(endpoint) as (proxy, script):
        s3c, sqsc = _clients(await proxy.endpoint(1))
        async with s3c as s3, sqsc:
            await s3.create_bucket(Bucket="jobs")
            await s3.put_object(Bucket="jobs", Key="there", Body=b"12345")
            head = await s3.head_object(Bucket="jobs", Key="there")
            script.once["HeadObject"] = "forbid_missing"
            with pytest.raises(ClientError) as denied:
                await s3.head_object(Bucket="jobs", Key="missing")
        assert head["ContentLength"] == 5  # a HEAD's length survives the proxy
        assert denied.value.response["Error"]["Code"] in ("403", "AccessDenied")


async def test_a_second_delivery_has_its_own_handle_and_one_more_receive(endpoint: str) -> None:
    """As SQS delivers a message in flight to a second consumer: a receipt handle of its own (that
    works: the proxy maps it back), ``ApproximateReceiveCount`` one higher."""
    async with proxied(endpoint) as (proxy, script):
        s3_1c, sqs1_c = _clients(await proxy.endpoint(1))
        s3_2c, sqs2_c = _clients(await proxy.endpoint(2))
        async with s3_1c, s3_2c, sqs1_c as sqs1, sqs2_c as sqs2:
            url = (await sqs1.create_queue(QueueName="again"))["QueueUrl"]
            await sqs1.send_message(QueueUrl=url, MessageBody="once")
            attrs = {"MessageSystemAttributeNames": ["ApproximateReceiveCount"]}
            [held] = (await sqs1.receive_message(QueueUrl=url, **attrs))["Messages"]
            script.once["ReceiveMessage"] = "redeliver"
            [again] = (await sqs2.receive_message(QueueUrl=url, **attrs))["Messages"]
            await sqs2.change_message_visibility(
                QueueUrl=url, ReceiptHandle=again["ReceiptHandle"], VisibilityTimeout=5
            )
            await sqs2.delete_message(QueueUrl=url, ReceiptHandle=again["ReceiptHandle"])
            left = await receive_all(sqs2, url, wait=1)
    assert again["Body"] == "once" and again["ReceiptHandle"] != held["ReceiptHandle"]
    assert held["Attributes"]["ApproximateReceiveCount"] == "1"
    assert again["Attributes"]["ApproximateReceiveCount"] == "2"
    assert left == []  # its own handle deleted the message


async def test_a_409_and_a_kill_inside_a_read(endpoint: str) -> None:
    async with proxied(endpoint) as (proxy, script):
        s3c, sqsc = _clients(await proxy.endpoint(1), retries={"total_max_attempts": 1})
        async with aws_clients(endpoint) as (direct, _), s3c as s3, sqsc:
            await direct.create_bucket(Bucket="jobs")
            await direct.put_object(Bucket="jobs", Key="big", Body=b"x" * 100_000)
            script.once["PutObject"] = "conflict_409"
            with pytest.raises(ClientError) as conflict:
                await s3.put_object(Bucket="jobs", Key="new", Body=b"x", IfNoneMatch="*")
            script.once["GetObject"] = "kill_during"
            got = await s3.get_object(Bucket="jobs", Key="big")
            with pytest.raises(Exception):  # noqa: B017 - cut off mid-body, whatever aiohttp names it
                async with got["Body"] as body:
                    await body.read()
            listed = await direct.list_objects_v2(Bucket="jobs")
    assert conflict.value.response["Error"]["Code"] == "ConditionalRequestConflict"
    assert conflict.value.response["ResponseMetadata"]["HTTPStatusCode"] == 409
    assert [o["Key"] for o in listed["Contents"]] == ["big"]  # the 409 wrote nothing
    assert proxy.dead(1)
