"""InvokeEndpointWithResponseStream through boto3: the container's JSON Lines and chat SSE arrive as
PayloadPart events botocore decodes (CRCs checked), as they are produced; a container that breaks
off ends the stream with ModelStreamError; a caller that hangs up stops the container's work."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from typing import Any

import pytest
from aiohttp import web
from botocore.exceptions import EventStreamError

from tests.emulator.support import container, front, runtime, stand_in
from tests.fakes import decision_line

pytestmark = pytest.mark.timeout(180)


def parts(stream: Any) -> list[bytes]:
    return [event["PayloadPart"]["Bytes"] for event in stream]


def essentials(record: dict[str, Any]) -> Any:
    """What a record says, without its run-dependent timing and cache status."""
    if "error" in record:
        return record["line"], record["id"], record["error"]["code"]
    result = record["result"]
    return record["line"], record["id"], result["option_ids"], result["probabilities"]


@pytest.mark.real_model
def test_json_lines_stream_as_payload_parts_equal_to_the_containers_answer(
    engine: Any, endpoint: str
) -> None:
    body = ("\n".join(decision_line(i) for i in range(3)) + "\nnot json\n").encode()
    with container(engine) as url, front(url, endpoint) as api:
        got = runtime(api).invoke_endpoint_with_response_stream(
            EndpointName="arbiter", ContentType="application/jsonlines", Body=body
        )
        streamed = b"".join(parts(got["Body"]))
        direct = urllib.request.urlopen(
            urllib.request.Request(
                url + "/invocations", body, {"Content-Type": "application/jsonlines"}
            ),
            timeout=60,
        ).read()
    assert got["ContentType"] == "application/jsonlines"
    assert got["InvokedProductionVariant"] == "AllTraffic"
    mine = [essentials(json.loads(line)) for line in streamed.splitlines()]
    assert mine == [essentials(json.loads(line)) for line in direct.splitlines()]
    assert [m[1] for m in mine] == ["d0", "d1", "d2", None]  # the bad line in its place


@pytest.mark.real_model
def test_chat_server_sent_events_stream_through(chat_engine: Any, endpoint: str) -> None:
    chat = {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    with container(chat_engine) as url, front(url, endpoint) as api:
        got = runtime(api).invoke_endpoint_with_response_stream(
            EndpointName="arbiter", ContentType="application/json", Body=json.dumps(chat)
        )
        text = b"".join(parts(got["Body"])).decode()
    assert got["ContentType"].startswith("text/event-stream")
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_parts_arrive_as_the_container_writes_them(endpoint: str) -> None:
    """The second piece is written only after the caller has the first: a front that buffered
    the response would never deliver it."""
    gates = [threading.Event() for _ in range(3)]
    with stand_in() as (fake, url), front(url, endpoint) as api:

        async def pieces(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "application/jsonlines"})
            await response.prepare(request)
            for n, gate in enumerate(gates):
                await response.write(f'{{"n": {n}}}\n'.encode())
                if not await asyncio.to_thread(gate.wait, 30):
                    raise AssertionError("the caller never got the piece")
            await response.write_eof()
            return response

        fake.respond = pieces
        got = runtime(api).invoke_endpoint_with_response_stream(
            EndpointName="arbiter", ContentType="application/jsonlines", Body=b"{}\n"
        )
        received = []
        for n, event in enumerate(got["Body"]):
            received.append(event["PayloadPart"]["Bytes"])
            gates[min(n, 2)].set()
    assert b"".join(received) == b'{"n": 0}\n{"n": 1}\n{"n": 2}\n'
    assert len(received) >= 3


def test_a_container_that_breaks_off_ends_the_stream_with_a_model_stream_error(
    endpoint: str,
) -> None:
    with stand_in() as (fake, url), front(url, endpoint) as api:

        async def broken(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "application/jsonlines"})
            await response.prepare(request)
            await response.write(b'{"n": 0}\n')
            await asyncio.sleep(0.1)
            assert request.transport is not None
            request.transport.abort()  # the container dies mid-answer
            return response

        fake.respond = broken
        got = runtime(api).invoke_endpoint_with_response_stream(
            EndpointName="arbiter", ContentType="application/jsonlines", Body=b"{}\n"
        )
        received = []
        try:
            with pytest.raises(EventStreamError) as caught:
                for event in got["Body"]:
                    received.append(event["PayloadPart"]["Bytes"])
        finally:
            # A stream that raised keeps its connection checked out of the pool, so closing the
            # client would not close it; left to the collector, it warns in a later test.
            got["Body"].close()
    assert b"".join(received) == b'{"n": 0}\n'
    assert caught.value.response["Error"]["Code"] == "ModelStreamError"
    assert "closed" in caught.value.response["Error"]["Message"]


def test_a_refusal_before_the_stream_is_a_model_error(endpoint: str) -> None:
    with stand_in() as (fake, url), front(url, endpoint) as api:

        async def refuse(request: web.Request) -> web.Response:
            return web.json_response({"error": "no"}, status=415)

        fake.respond = refuse
        client = runtime(api)
        with pytest.raises(client.exceptions.ModelError) as caught:
            client.invoke_endpoint_with_response_stream(
                EndpointName="arbiter", ContentType="text/plain", Body=b"x"
            )
    assert caught.value.response["OriginalStatusCode"] == 415


def test_a_caller_that_hangs_up_stops_the_containers_stream(endpoint: str) -> None:
    wrote = []
    ended = threading.Event()
    with stand_in() as (fake, url), front(url, endpoint) as api:

        async def endless(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "application/jsonlines"})
            await response.prepare(request)
            try:
                for n in range(400):
                    await response.write(b'{"n": %d}\n' % n)
                    wrote.append(n)
                    await asyncio.sleep(0.05)
            finally:
                ended.set()
            return response

        fake.respond = endless
        got = runtime(api).invoke_endpoint_with_response_stream(
            EndpointName="arbiter", ContentType="application/jsonlines", Body=b"{}\n"
        )
        next(iter(got["Body"]))
        got["Body"].close()
        assert ended.wait(30), "the container kept streaming to nobody"
        time.sleep(0.1)
    assert len(wrote) < 400
