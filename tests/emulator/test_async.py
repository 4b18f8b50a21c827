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
