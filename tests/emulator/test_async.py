"""InvokeEndpointAsync through boto3, then S3 and SNS as an application reads them: 202 with the
locations, the output or failure object, the notifications on the template's topics, the request
TTL and invocation timeout, at most MaxConcurrentInvocationsPerInstance at once, the backlog metric."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from typing import Any

import pytest
from aiohttp import web
from botocore.exceptions import ClientError

from tests.emulator.support import (
    BUCKET,
    aws,
    container,
    exists,
    front,
    make_bucket,
    notifications,
    poll_object,
    runtime,
    stand_in,
    subscribe,
)
from tests.fakes import decision_line

pytestmark = pytest.mark.timeout(180)


poll = poll_object


def metric(api: str, name: str) -> float:
    text = urllib.request.urlopen(api + "/metrics", timeout=10).read().decode()
    [line] = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


def metric_becomes(api: str, name: str, value: float, within_s: float = 10) -> float:
    """The backlog gauge is the queue's approximate count, refreshed each second (as SageMaker's
    ApproximateBacklogSize is a CloudWatch figure): polled until it reads ``value``."""
    deadline = time.monotonic() + within_s
    while (got := metric(api, name)) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


@pytest.mark.real_model
def test_an_async_invocation_writes_its_output_and_notifies_success(
    engine: Any, endpoint: str
) -> None:
    s3 = make_bucket(endpoint)
    body = "\n".join(decision_line(i) for i in range(2)) + "\n"
    s3.put_object(Bucket=BUCKET, Key="async/input/two.jsonl", Body=body.encode())
    with container(engine) as url, front(url, endpoint) as api:
        topics = subscribe(endpoint)
        got = runtime(api).invoke_endpoint_async(
            EndpointName="arbiter-async",
            ContentType="application/jsonlines",
            InputLocation=f"s3://{BUCKET}/async/input/two.jsonl",
        )
        output = poll(s3, got["OutputLocation"])
        [note] = notifications(endpoint, topics["success"])
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 202
    assert got["OutputLocation"] == f"s3://{BUCKET}/async/output/{got['InferenceId']}.out"
    assert got["FailureLocation"] == f"s3://{BUCKET}/async/failures/{got['InferenceId']}-error.out"
    records = [json.loads(line) for line in output.splitlines()]
    assert [r["id"] for r in records] == ["d0", "d1"] and all("result" in r for r in records)
    assert note["invocationStatus"] == "Completed"
    assert note["inferenceId"] == got["InferenceId"]
    assert note["responseParameters"]["outputLocation"] == got["OutputLocation"]
    assert note["requestParameters"]["inputLocation"] == f"s3://{BUCKET}/async/input/two.jsonl"
    assert note["eventSource"] == "aws:sagemaker" and note["eventName"] == "InferenceResult"
    assert not exists(s3, got["FailureLocation"])


@pytest.mark.real_model
def test_a_container_refusal_is_written_to_the_failure_location_and_notified(
    engine: Any, endpoint: str
) -> None:
    s3 = make_bucket(endpoint)
    with container(engine) as url, front(url, endpoint) as api:
        topics = subscribe(endpoint)
        got = runtime(api).invoke_endpoint_async(
            EndpointName="arbiter-async",
            ContentType="application/json",
            Body=b'{"neither": "decision nor decisions"}',
            InferenceId="mine-1",
        )
        failure = poll(s3, got["FailureLocation"])
        [note] = notifications(endpoint, topics["error"])
    assert got["InferenceId"] == "mine-1"
    assert json.loads(failure)["error"]["code"] == "unknown_request_shape"  # the container's body
    assert note["invocationStatus"] == "Failed" and note["inferenceId"] == "mine-1"
    assert "(422)" in note["failureReason"]
    assert note["responseParameters"]["failureLocation"] == got["FailureLocation"]
    assert not exists(s3, got["OutputLocation"])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_request_older_than_its_ttl_expires_unprocessed(endpoint: str) -> None:
    """One slot (the template's MaxInFlight): A holds it; B waits past its RequestTTLSeconds
    (the front's clock is moved on, not slept); then A finishes and B expires unprocessed."""
    s3 = make_bucket(endpoint)
    clock = Clock()
    release = threading.Event()
    with stand_in() as (fake, url), front(url, endpoint, clock=clock) as api:
        topics = subscribe(endpoint)

        async def held(request: web.Request) -> web.Response:
            await asyncio.to_thread(release.wait, 60)
            return web.json_response({"ok": True})

        fake.respond = held
        client = runtime(api)
        first = client.invoke_endpoint_async(
            EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
        )
        second = client.invoke_endpoint_async(
            EndpointName="arbiter-async",
            ContentType="application/json",
            Body=b"{}",
            RequestTTLSeconds=60,
        )
        # one in flight, one queued
        assert metric_becomes(api, "arbiter_runtime_async_backlog", 2) == 2
        clock.now += 61
        release.set()
        poll(s3, first["OutputLocation"])
        [note] = notifications(endpoint, topics["error"])
        failure = json.loads(poll(s3, second["FailureLocation"]))
        assert metric_becomes(api, "arbiter_runtime_async_backlog", 0) == 0
    assert note["inferenceId"] == second["InferenceId"]
    assert note["failureReason"].startswith("Request expired")
    assert note["responseParameters"]["failureLocation"] == second["FailureLocation"]
    assert failure == {"inferenceId": second["InferenceId"], "failureReason": note["failureReason"]}
    assert len(fake.seen) == 1  # the container never saw the expired request
    assert not exists(s3, second["OutputLocation"])


def test_at_most_max_concurrent_invocations_reach_the_container(endpoint: str) -> None:
    """MaxInFlight 2 (ARBITER_MAX_IN_FLIGHT) is the template's MaxConcurrentInvocationsPerInstance:
    of five requests two are in the container at once, the others wait in the backlog."""
    s3 = make_bucket(endpoint)
    release = threading.Event()
    with stand_in() as (fake, url), front(url, endpoint, max_in_flight=2) as api:

        async def held(request: web.Request) -> web.Response:
            await asyncio.to_thread(release.wait, 60)
            return web.json_response({"ok": True})

        fake.respond = held
        client = runtime(api)
        calls = [
            client.invoke_endpoint_async(
                EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
            )
            for _ in range(5)
        ]
        deadline = time.monotonic() + 30
        while fake.active < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # room for a third, if the bound were wrong
        assert fake.active == 2
        assert metric_becomes(api, "arbiter_runtime_async_backlog", 5) == 5
        release.set()
        outputs = [poll(s3, c["OutputLocation"]) for c in calls]
    assert fake.most_active == 2
    assert outputs == [b'{"ok": true}'] * 5


def test_an_invocation_over_its_timeout_fails_with_a_failure_object(endpoint: str) -> None:
    s3 = make_bucket(endpoint)
    with stand_in() as (fake, url), front(url, endpoint) as api:
        topics = subscribe(endpoint)

        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(3)
            return web.json_response({"late": True})

        fake.respond = slow
        got = runtime(api).invoke_endpoint_async(
            EndpointName="arbiter-async",
            ContentType="application/json",
            Body=b"{}",
            InvocationTimeoutSeconds=1,
        )
        [note] = notifications(endpoint, topics["error"])
        failure = json.loads(poll(s3, got["FailureLocation"]))
    assert note["failureReason"].startswith("Invocation timed out")
    assert failure["failureReason"] == note["failureReason"]
    assert not exists(s3, got["OutputLocation"])


def test_output_names_inline_bodies_and_missing_inputs(endpoint: str) -> None:
    s3 = make_bucket(endpoint)
    with stand_in() as (fake, url), front(url, endpoint) as api:
        topics = subscribe(endpoint)
        client = runtime(api)
        named = client.invoke_endpoint_async(
            EndpointName="arbiter-async",
            ContentType="application/json",
            Body=b'{"x": 1}',
            S3OutputPathExtension="team/a",
            Filename="answer.json",
        )
        assert named["OutputLocation"] == f"s3://{BUCKET}/async/output/team/a/answer.json"
        assert poll(s3, named["OutputLocation"]) == b'{"ok": true}'
        assert fake.seen[0]["body"] == b'{"x": 1}'
        assert fake.seen[0]["headers"]["Content-Type"] == "application/json"
        missing = client.invoke_endpoint_async(
            EndpointName="arbiter-async", InputLocation=f"s3://{BUCKET}/async/input/none.jsonl"
        )
        notes = notifications(endpoint, topics["error"])
        with pytest.raises(client.exceptions.ValidationError):
            client.invoke_endpoint_async(EndpointName="arbiter-async")  # neither input nor body
        with pytest.raises(client.exceptions.ValidationError):
            client.invoke_endpoint_async(EndpointName="arbiter-async", InputLocation="/tmp/x.json")
    [note] = notes
    assert note["inferenceId"] == missing["InferenceId"]
    assert "could not read the input" in note["failureReason"]
    assert (
        "could not read the input"
        in json.loads(poll(s3, missing["FailureLocation"]))["failureReason"]
    )
    assert len(fake.seen) == 1
    assert aws("sns", endpoint).list_topics()["Topics"]  # the template's topics exist


def test_a_full_backlog_answers_service_unavailable(endpoint: str) -> None:
    make_bucket(endpoint)
    release = threading.Event()
    with stand_in() as (fake, url), front(url, endpoint, max_backlog=2) as api:

        async def held(request: web.Request) -> web.Response:
            await asyncio.to_thread(release.wait, 60)
            return web.json_response({"ok": True})

        fake.respond = held
        client = runtime(api, retries={"max_attempts": 1, "mode": "standard"})
        for _ in range(2):
            client.invoke_endpoint_async(
                EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
            )
        with pytest.raises(ClientError) as caught:
            client.invoke_endpoint_async(
                EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
            )
        release.set()
    assert caught.value.response["Error"]["Code"] == "ServiceUnavailable"
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503


def test_a_container_busy_with_real_time_traffic_delays_an_async_request_not_fails_it(
    endpoint: str,
) -> None:
    """Issue 37 item 7: the container's 503 says `retryable` (its admission is full of real-time
    calls, which on AWS would not share the async endpoint's instances): the request goes back to
    the queue for the Retry-After and is answered once there is room, no failure object."""
    s3 = make_bucket(endpoint)
    with stand_in() as (fake, url):
        calls = 0

        async def busy_twice(request: web.Request) -> web.Response:
            nonlocal calls
            calls += 1
            if calls <= 2:
                error = {"type": "overloaded", "code": "busy", "message": "full", "retryable": True}
                return web.json_response({"error": error}, status=503, headers={"Retry-After": "1"})
            return web.json_response({"ok": True})

        fake.respond = busy_twice
        with front(url, endpoint) as api:
            got = runtime(api).invoke_endpoint_async(
                EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
            )
            assert poll(s3, got["OutputLocation"], 30) == b'{"ok": true}'
    assert calls == 3
    assert not exists(s3, got["FailureLocation"])


def test_a_503_that_is_not_retryable_is_still_the_models_answer(endpoint: str) -> None:
    s3 = make_bucket(endpoint)
    with stand_in() as (fake, url):

        async def broken(request: web.Request) -> web.Response:
            return web.json_response({"error": {"message": "broken"}}, status=503)

        fake.respond = broken
        with front(url, endpoint) as api:
            got = runtime(api).invoke_endpoint_async(
                EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
            )
            failure = json.loads(poll(s3, got["FailureLocation"], 30))
    assert failure == {"error": {"message": "broken"}} and len(fake.seen) == 1


def test_a_changed_visibility_setting_reconfigures_the_backlog_queue(endpoint: str) -> None:
    """Issue 37 item 8: the backlog queue made with one ARBITER_RUNTIME_VISIBILITY_S, the front
    started again with another. CreateQueue refuses different attributes (QueueAlreadyExists, on
    AWS too): the front crashed at start and the backlog waited unanswered. Now the queue takes
    the new setting and keeps its messages."""
    s3 = make_bucket(endpoint)
    sqs = aws("sqs", endpoint)
    with front("http://127.0.0.1:9", endpoint, visibility_s=60) as api:  # no container: it waits
        got = runtime(api).invoke_endpoint_async(
            EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
        )
    url = sqs.get_queue_url(QueueName="arbiter-async-backlog")["QueueUrl"]
    with stand_in() as (_, container_url), front(container_url, endpoint, visibility_s=30):
        attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["VisibilityTimeout"])
        assert poll(s3, got["OutputLocation"], 30) == b'{"ok": true}'
    assert attributes["Attributes"]["VisibilityTimeout"] == "30"


def test_a_backlog_message_that_cannot_be_read_but_names_its_locations_is_answered(
    endpoint: str,
) -> None:
    """Issue 37 item 12: a message that is not a whole request (a field broken) but names its
    inference id and locations gets a failure object and the error notification, instead of
    being deleted unanswered; one that names nothing is deleted (there is no one to answer)."""
    s3 = make_bucket(endpoint)
    sqs = aws("sqs", endpoint)
    with stand_in() as (fake, url), front(url, endpoint) as api:
        topics = subscribe(endpoint)
        queue = sqs.get_queue_url(QueueName="arbiter-async-backlog")["QueueUrl"]
        broken = {
            "inference_id": "broken-1",
            "output": f"s3://{BUCKET}/async/output/broken-1.out",
            "failure": f"s3://{BUCKET}/async/failures/broken-1-error.out",
            "body": "not base64!",
        }
        sqs.send_message(QueueUrl=queue, MessageBody=json.dumps(broken))
        sqs.send_message(QueueUrl=queue, MessageBody="not even JSON")
        failure = json.loads(poll(s3, broken["failure"], 30))
        [note] = notifications(endpoint, topics["error"])
        assert metric_becomes(api, "arbiter_runtime_async_backlog", 0) == 0
    assert failure["inferenceId"] == "broken-1" and "could not be read" in failure["failureReason"]
    assert note["inferenceId"] == "broken-1" and note["invocationStatus"] == "Failed"
    assert not exists(s3, broken["output"]) and fake.seen == []


def test_an_input_over_the_1_gb_limit_fails_without_reaching_the_container(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37 item 11: the 1 GB async input limit was documented, not enforced (1.1 GB was
    answered). The limit is lowered here so that the test does not write a gigabyte."""
    from emulator import limits

    monkeypatch.setattr(limits, "MAX_ASYNC_INPUT_BYTES", 1000)
    s3 = make_bucket(endpoint)
    s3.put_object(Bucket=BUCKET, Key="async/input/big.jsonl", Body=b"x" * 1001)
    s3.put_object(Bucket=BUCKET, Key="async/input/fits.jsonl", Body=b"x" * 1000)
    with stand_in() as (fake, url), front(url, endpoint) as api:
        client = runtime(api)
        big, fits = (
            client.invoke_endpoint_async(
                EndpointName="arbiter-async",
                ContentType="application/json",
                InputLocation=f"s3://{BUCKET}/async/input/{name}.jsonl",
            )
            for name in ("big", "fits")
        )
        failure = json.loads(poll(s3, big["FailureLocation"], 30))
        assert poll(s3, fits["OutputLocation"], 30) == b'{"ok": true}'
    assert "1,001 bytes, over" in failure["failureReason"] and "1 GB" in failure["failureReason"]
    assert [len(seen["body"]) for seen in fake.seen] == [1000]  # the big one never sent
