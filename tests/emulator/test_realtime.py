"""InvokeEndpoint through boto3's own sagemaker-runtime client: SageMaker's output shape, its header
mapping both ways, and its errors (ModelError on a container 422 and 503, ValidationError for an
unknown endpoint, a container that does not answer in time)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Any

import pytest
from aiohttp import web
from botocore.exceptions import ClientError

from tests.emulator.support import container, front, runtime, stand_in
from tests.fakes import FakeEngine, decision_body

pytestmark = pytest.mark.timeout(120)
ONE = json.dumps({"decision": decision_body("t1")}).encode()
MESSAGE = re.compile(
    r'^Received (client|server) error \((\d+)\) from primary with message "(.*)"\. See https://'
    r"us-east-1\.console\.aws\.amazon\.com/cloudwatch/home\?region=us-east-1#logEventViewer:"
    r"group=/aws/sagemaker/Endpoints/arbiter in account 123456789012 for more information\.$",
    re.S,
)


def error_of(call: Any) -> ClientError:
    with pytest.raises(ClientError) as caught:
        call()
    return caught.value


@pytest.mark.real_model
def test_invoke_endpoint_returns_the_containers_decision_in_sagemakers_shape(
    engine: Any, endpoint: str
) -> None:
    with container(engine) as url, front(url, endpoint) as api:
        got = runtime(api).invoke_endpoint(
            EndpointName="arbiter",
            ContentType="application/json",
            Accept="application/json",
            Body=ONE,
            CustomAttributes="request_id=r-1",
        )
    body = json.loads(got["Body"].read())
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert got["ContentType"] == "application/json"
    assert got["InvokedProductionVariant"] == "AllTraffic"  # serving.yaml's VariantName
    assert got["CustomAttributes"] == "request_id=r-1"  # the container echoes it back
    result = body["result"]
    assert result["id"] == "t1" and abs(sum(result["probabilities"]) - 1) < 1e-6


def test_sagemakers_headers_reach_the_container_and_only_its_own_come_back(endpoint: str) -> None:
    with stand_in() as (fake, url), front(url, endpoint) as api:

        async def answer(request: web.Request) -> web.Response:
            return web.Response(
                body=b"a,b\n",
                content_type="text/csv",
                headers={"X-Amzn-SageMaker-Custom-Attributes": "trace=9", "X-Private": "no"},
            )

        fake.respond = answer
        got = runtime(api).invoke_endpoint(
            EndpointName="arbiter",
            Body=b"1,2",
            ContentType="text/csv",
            Accept="text/csv",
            CustomAttributes="c=1",
            TargetVariant="AllTraffic",
            InferenceId="inf-7",
        )
    sent = fake.seen[0]["headers"]
    assert sent["Content-Type"] == "text/csv" and sent["Accept"] == "text/csv"
    assert sent["X-Amzn-SageMaker-Custom-Attributes"] == "c=1"
    assert sent["X-Amzn-SageMaker-Inference-Id"] == "inf-7"
    assert "X-Amzn-SageMaker-Target-Variant" not in sent and "Authorization" not in sent
    assert fake.seen[0]["body"] == b"1,2"
    assert got["Body"].read() == b"a,b\n"
    assert got["ContentType"].startswith("text/csv")
    assert got["CustomAttributes"] == "trace=9"
    assert "x-private" not in got["ResponseMetadata"]["HTTPHeaders"]


@pytest.mark.real_model
def test_a_container_422_is_a_model_error_carrying_its_status_and_body(
    engine: Any, endpoint: str
) -> None:
    bad = json.dumps({"decision": {**decision_body(), "options": []}}).encode()
    with container(engine) as url, front(url, endpoint) as api:
        client = runtime(api)
        exc = error_of(
            lambda: client.invoke_endpoint(
                EndpointName="arbiter", ContentType="application/json", Body=bad
            )
        )
    assert isinstance(exc, client.exceptions.ModelError)
    assert exc.response["Error"]["Code"] == "ModelError"
    assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 424
    assert exc.response["OriginalStatusCode"] == 422
    original = json.loads(exc.response["OriginalMessage"])
    assert original["error"]["param"].startswith("decision.options")
    words = MESSAGE.match(exc.response["Error"]["Message"])
    assert words is not None and words.groups()[:2] == ("client", "422")
    assert json.loads(words.group(3)) == original
    assert exc.response["LogStreamArn"].endswith(":log-group:/aws/sagemaker/Endpoints/arbiter")
    assert exc.response["ResponseMetadata"]["RetryAttempts"] == 0


def test_a_container_503_is_a_model_error_not_a_throttle_and_is_not_retried(endpoint: str) -> None:
    """The container is loading its model (503 + Retry-After): SageMaker passes it as ModelError
    with OriginalStatusCode 503, which botocore does not retry; the application must."""
    loaded = threading.Event()

    def slow_model() -> FakeEngine:
        loaded.wait(60)
        return FakeEngine()

    try:
        with (
            container(None, ready_path="/openapi.json", factory=slow_model) as url,
            front(url, endpoint) as api,
        ):
            client = runtime(api)
            exc = error_of(
                lambda: client.invoke_endpoint(
                    EndpointName="arbiter", ContentType="application/json", Body=ONE
                )
            )
            loaded.set()
    finally:
        loaded.set()
    assert exc.response["Error"]["Code"] == "ModelError"
    assert exc.response["OriginalStatusCode"] == 503
    assert json.loads(exc.response["OriginalMessage"])["error"]["retryable"] is True
    assert MESSAGE.match(exc.response["Error"]["Message"]).group(1) == "server"  # type: ignore[union-attr]
    assert exc.response["ResponseMetadata"]["RetryAttempts"] == 0


def test_an_unknown_endpoint_or_variant_is_a_validation_error(endpoint: str) -> None:
    with stand_in() as (fake, url), front(url, endpoint) as api:
        client = runtime(api)
        unknown = error_of(
            lambda: client.invoke_endpoint(EndpointName="other", ContentType="text/csv", Body=b"1")
        )
        variant = error_of(
            lambda: client.invoke_endpoint(
                EndpointName="arbiter", ContentType="text/csv", Body=b"1", TargetVariant="Blue"
            )
        )
        model = error_of(
            lambda: client.invoke_endpoint(
                EndpointName="arbiter", ContentType="text/csv", Body=b"1", TargetModel="m.tar.gz"
            )
        )
    assert isinstance(unknown, client.exceptions.ValidationError)
    assert unknown.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert unknown.response["Error"]["Message"] == (
        "Endpoint other of account 123456789012 not found."
    )
    assert isinstance(variant, client.exceptions.ValidationError)
    assert "Blue" in variant.response["Error"]["Message"]
    assert isinstance(model, client.exceptions.ValidationError)
    assert fake.seen == []  # nothing reached the container


def test_a_container_that_does_not_answer_in_time_is_a_model_error_with_status_0(
    endpoint: str,
) -> None:
    with stand_in() as (fake, url), front(url, endpoint, invocation_timeout_s=0.3) as api:

        async def hang(request: web.Request) -> web.Response:
            await asyncio.sleep(2)  # past the front's 0.3 s; the server's shutdown waits for it
            return web.Response(text="late")

        fake.respond = hang
        exc = error_of(
            lambda: runtime(api).invoke_endpoint(
                EndpointName="arbiter", ContentType="text/csv", Body=b"1"
            )
        )
    assert exc.response["Error"]["Code"] == "ModelError"
    assert exc.response["OriginalStatusCode"] == 0
    assert (
        "timed out while waiting for a response from container primary"
        in (exc.response["OriginalMessage"])
    )


def test_no_container_is_model_not_ready(endpoint: str) -> None:
    """Nothing answers /ping: the call never reaches a container (ModelNotReadyException, 429),
    as traffic reaches an instance on AWS only once its health check passes."""
    with front("http://127.0.0.1:9", endpoint) as api:
        client = runtime(api, retries={"max_attempts": 1, "mode": "standard"})
        exc = error_of(
            lambda: client.invoke_endpoint(
                EndpointName="arbiter", ContentType="text/csv", Body=b"1"
            )
        )
    assert exc.response["Error"]["Code"] == "ModelNotReadyException"
    assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 429


def test_each_endpoint_answers_only_its_modes_operations(endpoint: str) -> None:
    """`arbiter runtime` serves serving.yaml's two modes under two names, one of each, as
    `arbiter local` does: the other operations answer ValidationError, as on AWS an endpoint with an
    AsyncInferenceConfig accepts only asynchronous invocations."""
    with stand_in() as (fake, url), front(url, endpoint) as api:
        client = runtime(api)
        on_async = error_of(
            lambda: client.invoke_endpoint(EndpointName="arbiter-async", Body=b"{}")
        )
        on_async_stream = error_of(
            lambda: client.invoke_endpoint_with_response_stream(
                EndpointName="arbiter-async", Body=b"{}"
            )
        )
        on_real_time = error_of(
            lambda: client.invoke_endpoint_async(EndpointName="arbiter", Body=b"{}")
        )
        answered = client.invoke_endpoint(EndpointName="arbiter", Body=b"{}")
        assert answered["Body"].read() == b'{"ok": true}'
    for error in (on_async, on_async_stream, on_real_time):
        assert error.response["Error"]["Code"] == "ValidationError"
        assert error.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert "use InvokeEndpointAsync" in on_async.response["Error"]["Message"]
    assert "use InvokeEndpoint." in on_real_time.response["Error"]["Message"]
    assert answered["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert len(fake.seen) == 1


def test_a_front_can_serve_one_mode_alone(endpoint: str) -> None:
    with stand_in() as (fake, url), front(url, endpoint, async_endpoint_name="") as api:
        client = runtime(api)
        gone = error_of(
            lambda: client.invoke_endpoint_async(EndpointName="arbiter-async", Body=b"{}")
        )
        assert client.invoke_endpoint(EndpointName="arbiter", Body=b"{}")["Body"].read()
    assert gone.response["Error"]["Message"] == (
        "Endpoint arbiter-async of account 123456789012 not found."
    )
    assert len(fake.seen) == 1
