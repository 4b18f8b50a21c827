"""Abstention, orders read and the served calibration over loopback with the real bundled model:
/invocations, /v1/systemone (headers in, keys the SDK ignores out) and /v1/models."""

from __future__ import annotations

from typing import Any

import pytest
from typesafe_sdk import SystemOneResponse

pytestmark = pytest.mark.asyncio(loop_scope="session")

TICKET = "I was charged twice for my March invoice; please refund the duplicate payment."


def ticket(**extra: Any) -> dict[str, Any]:
    return {
        "id": "t",
        "state": TICKET,
        "question": "Which team should handle this ticket?",
        "options": [
            {"id": "billing", "description": "Billing and payments"},
            {"id": "shipping", "description": "Shipping and delivery"},
            {"id": "access", "description": "Account access"},
        ],
        **extra,
    }


async def test_a_decision_under_its_minimum_confidence_abstains_and_keeps_its_answer(
    client: Any,
) -> None:
    response = await client.post("/invocations", json={"decision": ticket(min_confidence=0.999)})
    assert response.status == 200
    result = (await response.json())["result"]
    assert result["abstained"] is True
    assert result["abstention"]["rule"] == "min_confidence"
    assert result["abstention"]["threshold"] == 0.999
    assert result["choice"] in {"billing", "shipping", "access"}
    assert result["orders_read"] >= 1
    plain = (await (await client.post("/invocations", json={"decision": ticket()})).json())[
        "result"
    ]
    assert plain["abstained"] is False and plain["abstention"] is None


async def test_an_error_budget_without_abstention_scores_names_the_field(client: Any) -> None:
    response = await client.post("/invocations", json={"decision": ticket(max_error=0.05)})
    assert response.status in (400, 422)
    error = (await response.json())["error"]
    assert error["param"] == "decision.max_error" and error["code"] == "not_calibrated"
    for bad in (0, 1, -0.1, "x"):
        response = await client.post("/invocations", json={"decision": ticket(max_error=bad)})
        assert response.status in (400, 422)
        assert "max_error" in (await response.json())["error"]["param"]


async def test_system_one_takes_the_budget_in_a_header(client: Any) -> None:
    body = {
        "model": "jev-latest",
        "state": TICKET,
        "questions": {
            "team": {"type": "choice", "criteria": {"billing": None, "shipping": None}},
            "refund": {"type": "noul", "instructions": "Is a refund requested?"},
        },
    }
    response = await client.post(
        "/v1/systemone", json=body, headers={"X-Arbiter-Min-Confidence": "0.999"}
    )
    assert response.status == 200
    raw = await response.json()
    assert all(a["abstained"] is True for a in raw["answers"].values())
    assert raw["answers"]["team"]["abstention"]["rule"] == "min_confidence"
    SystemOneResponse.model_validate(raw)  # the SDK reads it as before: the keys are extra
    plain = await (await client.post("/v1/systemone", json=body)).json()
    assert "abstained" not in plain["answers"]["team"]
    for header, value in (("X-Arbiter-Min-Confidence", "2"), ("X-Arbiter-Max-Error", "nope")):
        response = await client.post("/v1/systemone", json=body, headers={header: value})
        assert response.status == 422
        detail = (await response.json())["detail"][0]
        assert detail["loc"] == ["header", header.lower()]
    # A budget with no abstention scores: System One's 422, naming the header.
    response = await client.post(
        "/v1/systemone", json=body, headers={"X-Arbiter-Max-Error": "0.05"}
    )
    assert response.status == 422
    assert (await response.json())["detail"][0]["loc"] == ["header", "x-arbiter-max-error"]


async def test_models_lists_the_served_calibration(client: Any) -> None:
    listing = await (await client.get("/v1/models")).json()
    info = listing["data"][0]["meta"]["calibration"]
    assert info["order_policy"] == "adaptive"
    assert "source" in info
