"""The official TypeSafe SDK (`typesafe-sdk`) against a live `arbiter serve` on loopback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from typesafe_sdk import (
    AsyncTypeSafeClient,
    Choice,
    ChoiceAnswer,
    Noul,
    NoulAnswer,
    RetryPolicy,
    Score,
    ScoreAnswer,
    SystemOneResponse,
    TypeSafeAuthenticationError,
    TypeSafeClient,
    TypeSafeInternalServerError,
    TypeSafeUnprocessableEntityError,
)

from tests.environ import environ_without
from tests.ports import free_port

API_KEY = "test-key-123"
NO_RETRY = RetryPolicy(max_retries=0)
TICKET = {
    "ticket": "TCK-9",
    "messages": ["I was charged twice for March.", "Please refund the duplicate payment."],
    "customer": {"plan": "pro", "region": "EU"},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`arbiter serve` with the bundled model, an API key, and no queue (a second request is 503)."""
    port = free_port()
    env = {
        **environ_without("ARBITER_", "SM_"),
        "ARBITER_MODEL_DIR": str(tmp_path_factory.mktemp("no-model-dir")),
        "ARBITER_HOST": "127.0.0.1",
        "ARBITER_PORT": str(port),
        "ARBITER_API_KEY": API_KEY,
        "ARBITER_MAX_IN_FLIGHT": "1",
        "ARBITER_MAX_QUEUE": "0",
        "ARBITER_N_CTX": "2048",
    }
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "arbiter", "serve"], env=env, stdout=log, stderr=log
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, Path(log.name).read_text()
            try:
                with urllib.request.urlopen(f"{base}/ping", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            pytest.fail("arbiter serve did not become ready")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_sync_client_noul_choice_score_over_one_structured_state(server: str) -> None:
    with TypeSafeClient(
        api_key=API_KEY, base_url=server, model="jev-latest", retry=NO_RETRY, timeout=120
    ) as c:
        response = c.system_one(
            state=TICKET,
            questions={
                "refund": Noul(instructions="Does the customer ask for a refund?"),
                "team": Choice(
                    instructions="Which team should handle it?",
                    criteria={"billing": "Payments and invoices", "technical": None, "sales": None},
                ),
                "urgency": Score(
                    instructions="How urgent is the ticket?",
                    criteria=["not urgent", "somewhat urgent", "urgent"],
                ),
            },
        )
    assert isinstance(response, SystemOneResponse)
    assert response.model.startswith("arbiter/gemma-3-270m")
    refund, team, urgency = (response.answers[k] for k in ("refund", "team", "urgency"))
    assert isinstance(refund, NoulAnswer) and 0.0 < refund.noul < 1.0
    assert isinstance(team, ChoiceAnswer) and team.choice in {"billing", "technical", "sales"}
    assert list(team.probabilities) == ["billing", "technical", "sales"]
    assert sum(team.probabilities.values()) == pytest.approx(1.0)
    assert 0.0 <= team.confidence <= 1.0
    assert isinstance(urgency, ScoreAnswer)
    assert set(urgency.probabilities) == {0, 1, 2}
    assert urgency.score == pytest.approx(sum(k * p for k, p in urgency.probabilities.items()))
    assert urgency.legend[2] == "urgent"
    assert response.usage.output_tokens == 0
    assert response.usage.input_tokens is not None and response.usage.input_tokens > 0


async def test_async_client_and_the_served_model_id(server: str) -> None:
    async with AsyncTypeSafeClient(
        api_key=API_KEY, base_url=server, retry=NO_RETRY, timeout=120
    ) as client:
        listing = await client.models.list()
        names = [m.name for m in listing.models]
        assert "jev-latest" in names and "default" in names
        served = names[0]
        response = await client.system_one(
            state="The build failed because the disk is full.",
            model=served,
            questions={"infra": Noul(instructions="Is this an infrastructure problem?")},
        )
    assert response.model == served
    assert isinstance(response.answers["infra"], NoulAnswer)


def test_usage_counts_the_shared_state_once(server: str) -> None:
    questions = {f"q{i}": {"type": "noul", "instructions": f"Question {i}?"} for i in range(3)}
    body = json.dumps({"model": "default", "state": TICKET, "questions": questions}).encode()
    one = json.dumps(
        {"model": "default", "state": TICKET, "questions": {"q0": questions["q0"]}}
    ).encode()

    def post(data: bytes) -> dict[str, object]:
        request = urllib.request.Request(
            f"{server}/v1/systemone",
            data=data,
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.headers["x-request-id"]
            return json.loads(response.read())  # type: ignore[no-any-return]

    three, single = post(body), post(one)
    three_tokens = three["usage"]["input_tokens"]  # type: ignore[index]
    single_tokens = single["usage"]["input_tokens"]  # type: ignore[index]
    assert single_tokens < three_tokens < 2 * single_tokens


def test_invocations_answers_a_system_one_body_the_same_way(server: str) -> None:
    body = {
        "model": "default",
        "state": TICKET,
        "questions": {"refund": {"type": "noul", "instructions": "Is a refund requested?"}},
    }
    answers = []
    for path in ("/v1/systemone", "/invocations"):
        request = urllib.request.Request(
            server + path,
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answers.append(json.loads(response.read()))
    assert answers[0]["answers"]["refund"]["noul"] == pytest.approx(
        answers[1]["answers"]["refund"]["noul"], abs=1e-6
    )


def test_wrong_or_missing_key_raises_the_sdk_authentication_error(server: str) -> None:
    for key in ("wrong-key", " "):
        with (
            TypeSafeClient(
                api_key=key.strip() or "x", base_url=server, retry=NO_RETRY, timeout=120
            ) as c,
            pytest.raises(TypeSafeAuthenticationError),
        ):
            c.system_one(state="s", questions={"q": Noul(instructions="ok?")})
    request = urllib.request.Request(f"{server}/v1/systemone", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    info.value.close()
    assert info.value.code == 401 and info.value.headers["WWW-Authenticate"] == "Bearer"


def test_validation_failure_raises_the_sdk_422_naming_the_field(server: str) -> None:
    with TypeSafeClient(api_key=API_KEY, base_url=server, retry=NO_RETRY, timeout=120) as c:
        with pytest.raises(TypeSafeUnprocessableEntityError) as info:
            c.system_one(
                state="s",
                questions={"team": Choice(instructions="Which?", criteria={"only": None})},
            )
        detail = info.value.body["detail"]  # type: ignore[index]
        assert detail[0]["loc"][:4] == ["body", "questions", "team", "criteria"]
        with pytest.raises(TypeSafeUnprocessableEntityError) as info:
            c.system_one(state="s", model="gpt-4", questions={"q": Noul(instructions="ok?")})
        assert info.value.body["detail"][0]["loc"] == ["body", "model"]  # type: ignore[index]


async def test_busy_server_raises_the_sdk_server_error_with_retry_after(server: str) -> None:
    many = {f"q{i}": Noul(instructions=f"Is statement {i} true?") for i in range(8)}
    async with AsyncTypeSafeClient(
        api_key=API_KEY, base_url=server, retry=NO_RETRY, timeout=120
    ) as client:
        slow = asyncio.create_task(client.system_one(state=TICKET, questions=many))
        await asyncio.sleep(0.3)
        with pytest.raises(TypeSafeInternalServerError) as info:
            await client.system_one(state="other", questions={"q": Noul(instructions="ok?")})
        assert info.value.status == 503
        assert info.value.headers["retry-after"]
        assert len((await slow).answers) == 8
