"""An async request accepted is never lost, tried as an application would with boto3: one sent while
the container loads (or is not up at all) is answered once it is; six sent before a SIGTERM to
`arbiter runtime` are all answered after a restart (the backlog is an SQS queue, not the front's
memory); an answer whose S3 write fails becomes a failure object, and if that write fails too, the
error notification still says so."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.request
from typing import Any

import pytest
from aiohttp import web

from tests import ROOT
from tests.aws import reset_moto
from tests.emulator.support import (
    BUCKET,
    container,
    exists,
    front,
    make_bucket,
    notifications,
    poll_object,
    proxy,
    runtime,
    runtime_process,
    stand_in,
    subscribe,
)
from tests.environ import environ_without
from tests.fakes import decision_body
from tests.ports import free_port

pytestmark = pytest.mark.timeout(240)


@pytest.mark.real_model
def test_a_request_sent_while_the_model_loads_is_answered_once_it_is_up(
    engine: Any, endpoint: str
) -> None:
    """The real container, its model load held: /ping says 503, so the request waits in the
    backlog (it never reaches the container's 503) and is answered when the load ends."""
    s3 = make_bucket(endpoint)
    loaded = threading.Event()

    def slow_load() -> Any:
        loaded.wait(120)
        return engine

    with (
        container(engine, ready_path="/metrics", factory=slow_load) as url,
        front(url, endpoint) as api,
    ):
        topics = subscribe(endpoint)
        got = runtime(api).invoke_endpoint_async(
            EndpointName="arbiter-async",
            ContentType="application/json",
            Body=json.dumps({"decision": decision_body("while-loading")}).encode(),
        )
        time.sleep(2.0)  # the workers ping, back off, ping again meanwhile
        assert not exists(s3, got["OutputLocation"]) and not exists(s3, got["FailureLocation"])
        loaded.set()
        output = json.loads(poll_object(s3, got["OutputLocation"]))
        [note] = notifications(endpoint, topics["success"])
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
            counted = reply.read().decode()
    # Never sent while the model loaded: the container answered no 503 (a worker that did not
    # wait for the ping would have met it and been sent back to the queue by its Retry-After).
    answered = [
        line
        for line in counted.splitlines()
        if line.startswith("arbiter_requests_total") and 'route="/invocations"' in line
    ]
    assert any('status="200"' in line for line in answered), answered
    assert not any('status="503"' in line for line in answered), answered
    assert output["result"]["id"] == "while-loading"
    assert note["invocationStatus"] == "Completed" and note["inferenceId"] == got["InferenceId"]
    assert not exists(s3, got["FailureLocation"])


def test_a_request_sent_before_the_container_starts_waits_for_it(endpoint: str) -> None:
    s3 = make_bucket(endpoint)
    port = free_port()
    with front(f"http://127.0.0.1:{port}", endpoint) as api:
        got = runtime(api).invoke_endpoint_async(
            EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
        )
        time.sleep(1.5)  # nothing listens: the request waits, it does not fail
        assert not exists(s3, got["FailureLocation"])
        with stand_in(port=port) as (fake, _):
            assert poll_object(s3, got["OutputLocation"]) == b'{"ok": true}'
    assert len(fake.seen) == 1


def events(lines: list[str], name: str) -> list[dict[str, Any]]:
    found = []
    for line in lines:
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == name:
                found.append(record)
    return found


@pytest.mark.parametrize("drain", ["0.3", "6"])
def test_six_requests_a_sigterm_and_a_restart_all_six_answered(endpoint: str, drain: str) -> None:
    """One worker, each request 2 s in the container: at SIGTERM one request is in the container
    and five wait. The front takes no more. With a drain of 0.3 s the one in flight outlives it
    and is handed back (the log names it); with 6 s it finishes within it. Either way the
    restarted front answers the rest, and all six are answered."""
    s3 = make_bucket(endpoint)
    with stand_in() as (fake, url):

        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(2)
            return web.json_response({"answered": (await request.read()).decode()})

        fake.respond = slow
        port = free_port()
        env = environ_without("ARBITER_", "AWS_")
        env.update(
            PYTHONPATH=str(ROOT),
            ARBITER_AWS_ENDPOINT_URL=endpoint,
            ARBITER_RUNTIME_PORT=str(port),
            ARBITER_RUNTIME_CONTAINER_URL=url,
            ARBITER_MAX_IN_FLIGHT="1",
            ARBITER_RUNTIME_DRAIN_S=drain,
            ARBITER_LOG_JSON="true",
        )
        api = f"http://127.0.0.1:{port}"
        with runtime_process(env) as (first, before):
            client = runtime(api)
            calls = [
                client.invoke_endpoint_async(
                    EndpointName="arbiter-async", ContentType="text/plain", Body=f"r{i}".encode()
                )
                for i in range(6)
            ]
            deadline = time.monotonic() + 30
            while fake.active < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            first.send_signal(signal.SIGTERM)
            assert first.wait(timeout=60) == 0, "".join(before)
            seen_before_restart = len(fake.seen)
        assert seen_before_restart == 1  # nothing taken after the SIGTERM
        handed_back = [e["inference_id"] for e in events(before, "async_requeued")]
        answered = [exists(s3, c["OutputLocation"]) for c in calls]
        if drain == "0.3":
            assert handed_back == [calls[0]["InferenceId"]] and not any(answered)
        else:
            assert handed_back == [] and answered == [True] + [False] * 5
        with runtime_process(env) as (second, after):
            outputs = [json.loads(poll_object(s3, c["OutputLocation"], 30)) for c in calls]
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=60) == 0
    assert [o["answered"] for o in outputs] == [f"r{i}" for i in range(6)]
    # the one handed back was sent again, the others once
    assert len(fake.seen) == (7 if drain == "0.3" else 6)
    completed = {e["inference_id"] for e in events(before + after, "async_completed")}
    assert completed == {c["InferenceId"] for c in calls}


def test_a_front_waiting_for_a_container_that_never_came_stops_at_once(endpoint: str) -> None:
    """Its workers wait on the container's ping; a SIGTERM ends that wait, not the drain time
    (`arbiter local`'s Ctrl-C took 11 s while the runtime waited out 5 s of drain and 6 of take)."""
    make_bucket(endpoint)
    env = environ_without("ARBITER_", "AWS_")
    env.update(
        PYTHONPATH=str(ROOT),
        ARBITER_AWS_ENDPOINT_URL=endpoint,
        ARBITER_RUNTIME_PORT=str(free_port()),
        ARBITER_RUNTIME_CONTAINER_URL=f"http://127.0.0.1:{free_port()}",
        ARBITER_RUNTIME_DRAIN_S="10",
    )
    with runtime_process(env) as (front_process, lines):
        time.sleep(1.0)  # the workers are in their ping backoff
        front_process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert front_process.wait(timeout=30) == 0, "".join(lines)
        took = time.monotonic() - started
    assert took < 3, f"{took:.1f} s"


def _failing(prefixes: tuple[str, ...]) -> Any:
    def decide(call: Any) -> str:
        if call.service == "s3" and call.op == "PutObject" and call.key.startswith(prefixes):
            return "fail_500"
        return "forward"

    return decide


def test_an_answer_that_cannot_be_written_becomes_a_failure_object(endpoint: str) -> None:
    """S3 refuses every write under async/output/ (botocore retries, then gives up): the caller
    gets a failure object and an error notification, not silence."""
    s3 = make_bucket(endpoint)
    with (
        stand_in() as (_, url),
        proxy(endpoint, _failing(("async/output/",))) as faulty,
        front(url, faulty) as api,
    ):
        topics = subscribe(endpoint)
        got = runtime(api).invoke_endpoint_async(
            EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
        )
        failure = json.loads(poll_object(s3, got["FailureLocation"]))
        [note] = notifications(endpoint, topics["error"], wait_s=60)
    assert note["invocationStatus"] == "Failed" and note["inferenceId"] == got["InferenceId"]
    assert "could not be written" in note["failureReason"]
    assert failure["failureReason"] == note["failureReason"]
    assert note["responseParameters"]["failureLocation"] == got["FailureLocation"]
    assert not exists(s3, got["OutputLocation"])


def test_when_no_object_can_be_written_the_error_notification_says_why(endpoint: str) -> None:
    s3 = make_bucket(endpoint)
    with (
        stand_in() as (_, url),
        proxy(endpoint, _failing(("async/output/", "async/failures/"))) as faulty,
        front(url, faulty) as api,
    ):
        topics = subscribe(endpoint)
        got = runtime(api).invoke_endpoint_async(
            EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
        )
        # botocore retries each refused write (about 15 s each), then the front gives up on it
        [note] = notifications(endpoint, topics["error"], wait_s=90)
    assert note["invocationStatus"] == "Failed" and note["inferenceId"] == got["InferenceId"]
    assert "could not be written" in note["failureReason"]
    assert "failureLocation" not in note["responseParameters"]
    assert not exists(s3, got["OutputLocation"]) and not exists(s3, got["FailureLocation"])
    assert BUCKET in got["OutputLocation"]


def test_the_front_recovers_when_its_s3_and_sqs_server_restarts_empty(endpoint: str) -> None:
    """Issue 37 item 10: the S3/SQS/SNS server restarted without its state (its queue and topics
    gone): every InvokeEndpointAsync was ServiceUnavailable until the front itself restarted.
    Now the backlog queue and the topics are made anew and the next request is answered."""
    make_bucket(endpoint)
    with stand_in() as (_, url), front(url, endpoint) as api:
        client = runtime(api)
        client.invoke_endpoint_async(
            EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
        )
        reset_moto(endpoint)  # what a restarted server without state looks like
        s3 = make_bucket(endpoint)  # the stack's bucket, provisioned again
        got = client.invoke_endpoint_async(
            EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
        )
        assert poll_object(s3, got["OutputLocation"], 30) == b'{"ok": true}'
        topics = subscribe(endpoint)  # the topics are there again: made when it was answered
        again = client.invoke_endpoint_async(
            EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
        )
        assert poll_object(s3, again["OutputLocation"], 30) == b'{"ok": true}'
        # The first answer's own notice may still be on its retries (its topic was gone when it
        # first published) and reach the new subscription too: only the second's is asked for.
        notes: list[dict[str, Any]] = []
        for _ in range(10):
            notes += notifications(endpoint, topics["success"], wait_s=2)
            if any(n["inferenceId"] == again["InferenceId"] for n in notes):
                break
    assert [n for n in notes if n["inferenceId"] == again["InferenceId"]], notes


def test_an_outcome_that_cannot_be_recorded_waits_for_the_store_not_the_model(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37 item 13: S3 and SNS both refuse (403, not retried by botocore): the answer cannot
    be recorded, so the request goes back. It was sent to the container again every 30 s, without
    a cap; now no request reaches the container until the store answers again (its waits double),
    and then it is answered once."""
    from emulator import async_workers

    monkeypatch.setattr(async_workers, "RETRY_UNRECORDED_S", 1)  # 30 s in production
    down = threading.Event()
    down.set()

    def decide(call: Any) -> str:
        if down.is_set() and (call.service == "s3" or call.op == "Publish"):
            return "deny"
        return "forward"

    s3 = make_bucket(endpoint)
    with stand_in() as (fake, url), proxy(endpoint, decide) as faulty, front(url, faulty) as api:
        down.clear()  # the front made its topics and queue; now the store goes down
        got = runtime(api).invoke_endpoint_async(
            EndpointName="arbiter-async", ContentType="application/json", Body=b"{}"
        )
        down.set()
        deadline = time.monotonic() + 20
        while not fake.seen and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(6)  # 1 + 2 s of waits at least: the old front had re-sent it 5 times
        sent_while_down = len(fake.seen)
        down.clear()
        output = poll_object(s3, got["OutputLocation"], 40)
    assert sent_while_down == 1
    assert output == b'{"ok": true}' and len(fake.seen) == 2
