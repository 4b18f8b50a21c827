"""AWS's limits, as boto3 meets them: the header constraints of botocore's own sagemaker-runtime
model (botocore sends anything; AWS refuses it with a ValidationError naming the member), the 6 MB
real-time payloads both ways, custom attributes passed through byte for byte, and no content type
invented for a call that sent none."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web
from botocore.exceptions import ClientError

from emulator.limits import rules
from infra.patterns import java_pattern
from tests.emulator.support import front, make_bucket, runtime, stand_in

pytestmark = pytest.mark.timeout(120)
OPERATIONS = ("InvokeEndpoint", "InvokeEndpointAsync", "InvokeEndpointWithResponseStream")


def refused(call: Any) -> dict[str, Any]:
    with pytest.raises(ClientError) as caught:
        call()
    error: dict[str, Any] = caught.value.response["Error"]
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    return error


@pytest.mark.parametrize("operation", OPERATIONS)
def test_every_modelled_header_constraint_is_read_from_botocore(operation: str) -> None:
    import botocore.session

    shape = (
        botocore.session.get_session()
        .get_service_model("sagemaker-runtime")
        .operation_model(operation)
        .input_shape
    )
    modelled = {
        name
        for name, member in shape.members.items()
        if member.serialization.get("location") in ("header", "uri")
    }
    assert {rule.member for rule in rules(operation)} == modelled
    assert any(rule.pattern for rule in rules(operation))  # and every one of them compiled


@pytest.mark.parametrize(
    ("pattern", "good", "bad"),
    [
        (r"\p{ASCII}*", "trace=1; a b", "café"),
        (r"\A\S[\p{Print}]*\z", "inf-7 x", " leading"),
        (r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*", "my-endpoint", "my_endpoint"),
        (r"^(?!.*\..*\.)[a-zA-Z0-9][a-zA-Z0-9-_\.]*$", "answer.json", "a.b.c"),
    ],
)
def test_the_models_java_patterns_match_whole_values(pattern: str, good: str, bad: str) -> None:
    compiled = java_pattern(pattern)
    assert compiled.fullmatch(good) and not compiled.fullmatch(bad)
    with pytest.raises(ValueError):
        java_pattern(r"\p{Alpha}+")  # untranslated: refused, not guessed


def test_asyncs_named_refusals(endpoint: str) -> None:
    make_bucket(endpoint)
    with stand_in() as (fake, url), front(url, endpoint) as api:
        client = runtime(api)

        def call(**kw: Any) -> Any:
            return lambda: client.invoke_endpoint_async(
                EndpointName="arbiter-async", ContentType="application/json", Body=b"{}", **kw
            )

        traversal = refused(call(Filename="../../x"))
        evil = refused(call(S3OutputPathExtension="s3://evil"))
        long_id = refused(call(InferenceId="i" * 100))
        attributes = refused(call(CustomAttributes="a" * 1025))
        ttl = refused(call(RequestTTLSeconds=21_601))  # botocore checks only minima
        both = refused(call(Filename="a.b.c", InvocationTimeoutSeconds=3601))
        fine = client.invoke_endpoint_async(
            EndpointName="arbiter-async",
            ContentType="application/json",
            Body=b"{}",
            Filename="answer.json",
            S3OutputPathExtension="team/a",
            InferenceId="i" * 64,
            CustomAttributes="a" * 1024,
        )
    assert all(
        e["Code"] == "ValidationError" for e in (traversal, evil, long_id, attributes, ttl, both)
    )
    assert traversal["Message"] == (
        "1 validation error detected: Value '../../x' at 'filename' failed to satisfy "
        "constraint: Member must satisfy regular expression pattern: "
        r"^(?!.*\..*\.)[a-zA-Z0-9][a-zA-Z0-9-_\.]*$"
    )
    assert "at 's3OutputPathExtension' failed to satisfy constraint" in evil["Message"]
    assert (
        "at 'inferenceId'" in long_id["Message"]
        and "less than or equal to 64" in (long_id["Message"])
    )
    # CustomAttributes is sensitive in the model: its value is not echoed
    assert attributes["Message"] == (
        "1 validation error detected: Value '***' at 'customAttributes' failed to satisfy "
        "constraint: Member must have length less than or equal to 1024"
    )
    assert "less than or equal to 21600" in ttl["Message"]
    assert both["Message"].startswith("2 validation errors detected: ")
    assert fine["OutputLocation"].endswith("/async/output/team/a/answer.json")
    assert len(fake.seen) <= 1  # only the good call was queued


def test_a_7_mb_real_time_response_is_a_model_error_and_6_mb_requests_are_the_limit(
    endpoint: str,
) -> None:
    seven = b"x" * (7 * 1024 * 1024)
    with stand_in() as (fake, url), front(url, endpoint) as api:

        async def huge(request: web.Request) -> web.Response:
            return web.Response(body=seven, content_type="application/octet-stream")

        fake.respond = huge
        client = runtime(api, retries={"max_attempts": 1, "mode": "standard"})
        with pytest.raises(client.exceptions.ModelError) as caught:
            client.invoke_endpoint(EndpointName="arbiter", ContentType="text/plain", Body=b"1")
        too_big = refused(
            lambda: client.invoke_endpoint(
                EndpointName="arbiter", ContentType="text/plain", Body=b"y" * 6_291_457
            )
        )
        seen = len(fake.seen)
    error = caught.value.response
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 424
    assert error["OriginalStatusCode"] == 0
    assert "larger than 6291456 bytes" in error["OriginalMessage"]
    assert too_big["Code"] == "ValidationError" and "'body'" in too_big["Message"]
    assert seen == 1  # the oversized request never reached the container


def test_custom_attributes_are_ascii_in_and_passed_back_byte_for_byte(endpoint: str) -> None:
    """The model's pattern for CustomAttributes is \\p{ASCII}* (the API reference: "visible
    US-ASCII"): a non-ASCII value is refused. What the container sets comes back as its bytes;
    boto3 (http.client) reads response headers as Latin-1, so a UTF-8 value is re-decoded."""
    with stand_in() as (fake, url), front(url, endpoint) as api:

        async def attributes(request: web.Request) -> web.Response:
            return web.Response(
                text="{}",
                content_type="application/json",
                headers={"X-Amzn-SageMaker-Custom-Attributes": "trace=café ☕"},
            )

        fake.respond = attributes
        client = runtime(api)
        error = refused(
            lambda: client.invoke_endpoint(
                EndpointName="arbiter", Body=b"{}", CustomAttributes="café"
            )
        )
        got = client.invoke_endpoint(EndpointName="arbiter", Body=b"{}", CustomAttributes="c=1")
        got["Body"].read()
    assert "at 'customAttributes'" in error["Message"] and r"\p{ASCII}*" in error["Message"]
    assert got["CustomAttributes"].encode("latin-1").decode("utf-8") == "trace=café ☕"
    assert len(fake.seen) == 1


def test_custom_attributes_over_1024_characters_are_refused_both_ways(endpoint: str) -> None:
    """CustomAttributes is at most 1,024 characters in botocore's model, in and out. A caller's
    2,000 is a ValidationError; a container's is a ModelError naming its length (AWS documents
    the limit, not its error), never passed back whole; 1,024 comes back as it was set."""
    set_by_container = {"value": "a" * 1024}
    with stand_in() as (fake, url), front(url, endpoint) as api:

        async def attributes(request: web.Request) -> web.Response:
            return web.Response(
                text="{}",
                content_type="application/json",
                headers={"X-Amzn-SageMaker-Custom-Attributes": set_by_container["value"]},
            )

        fake.respond = attributes
        client = runtime(api, retries={"max_attempts": 1, "mode": "standard"})
        whole = client.invoke_endpoint(EndpointName="arbiter", Body=b"{}")["CustomAttributes"]
        caller = refused(
            lambda: client.invoke_endpoint(
                EndpointName="arbiter", Body=b"{}", CustomAttributes="c" * 2000
            )
        )
        set_by_container["value"] = "a" * 2000
        errors = []
        for call in (client.invoke_endpoint, client.invoke_endpoint_with_response_stream):
            with pytest.raises(client.exceptions.ModelError) as caught:
                call(EndpointName="arbiter", Body=b"{}")
            errors.append(caught.value.response)
    assert whole == "a" * 1024
    assert caller["Code"] == "ValidationError"
    assert "less than or equal to 1024" in caller["Message"]
    for error in errors:
        assert error["ResponseMetadata"]["HTTPStatusCode"] == 424
        assert "is 2000 characters" in error["OriginalMessage"], error
        assert "returns at most 1024" in error["OriginalMessage"], error


def test_no_header_is_invented(endpoint: str) -> None:
    """A call without ContentType or Accept reaches the container without them, nor any header
    the caller did not send, on all three operations (SageMaker passes the API's headers; aiohttp
    would otherwise add application/octet-stream, ``Accept: */*``, Accept-Encoding, User-Agent)."""
    s3 = make_bucket(endpoint)
    with stand_in() as (fake, url), front(url, endpoint) as api:
        client = runtime(api)
        client.invoke_endpoint(EndpointName="arbiter", Body=b"{}")["Body"].read()
        stream = client.invoke_endpoint_with_response_stream(EndpointName="arbiter", Body=b"{}")
        list(stream["Body"])
        s3.put_object(Bucket="arbiter-jobs", Key="async/input/x.json", Body=b"{}")
        done = client.invoke_endpoint_async(
            EndpointName="arbiter-async", InputLocation="s3://arbiter-jobs/async/input/x.json"
        )
        from tests.emulator.support import poll_object

        poll_object(s3, done["OutputLocation"])
    sent = [entry["headers"] for entry in fake.seen]
    assert len(sent) == 3
    assert [h.get("Content-Type") for h in sent] == [None, None, None]
    transport = {"Host", "Content-Length", "Transfer-Encoding"}
    # SageMaker's own: an async request always has an inference id (made when none was given)
    ours = {"X-Amzn-SageMaker-Inference-Id"}
    assert [sorted(set(h) - transport) for h in sent[:2]] == [[], []], sent
    assert sorted(set(sent[2]) - transport - ours) == [], sent
