"""The read check at load is reported in /v1/models and the metrics (issue 28)."""

from __future__ import annotations

from typing import Any

import pytest

from arbiter.engine import Engine

# Fixtures live on the session loop (pyproject: asyncio_default_fixture_loop_scope); so do tests.
pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_models_and_metrics_report_the_read_check(client: Any, engine: Engine) -> None:
    listing = await (await client.get("/v1/models")).json()
    reported = listing["data"][0]["meta"]["read_check"]
    assert reported["allowed_mass"] == pytest.approx(engine.read_check.allowed_mass)
    assert reported["passed"] is True and reported["mode"] == "refuse"
    metrics = await (await client.get("/metrics")).text()
    line = next(m for m in metrics.splitlines() if m.startswith("arbiter_read_check_allowed_mass"))
    assert float(line.split()[-1]) == pytest.approx(engine.read_check.allowed_mass)
