"""The seeded fault campaign (tests/faults/campaign.py), a dozen seeds of it: every job of every
seed finishes once, line for line, whatever the seed's faults. `make faults` runs more seeds (and
the black-box run), `make fuzz` thousands; ARBITER_CAMPAIGN_SEEDS=START:STOP picks others here."""

from __future__ import annotations

import json
import os

import pytest

from tests.faults.campaign import DEADLINE_S, _seeds, describe, run_seeds, totals
from tests.faults.invariants import redriven_messages

SEEDS = os.environ.get("ARBITER_CAMPAIGN_SEEDS", "0:12")

# Two waves of six seeds, each allowed campaign.DEADLINE_S (300 s) before it is reported as a hang:
# the suite's 300 s cut a loaded CI run (stop 39: 1,131 s for make test) in its second wave, with
# every seed still moving and no word of which, if any, hung.
WAVES_S = 2 * DEADLINE_S + 120


@pytest.mark.timeout(WAVES_S)
async def test_a_few_dozen_fault_seeds_find_nothing(endpoint: str) -> None:
    results = await run_seeds(_seeds(SEEDS), endpoint, concurrency=6)
    summary = totals(results)
    print(json.dumps(summary))
    if "ARBITER_CAMPAIGN_SEEDS" not in os.environ:  # a mutation's seeds may have neither
        assert summary["faults"].get("lose_response", 0) > 0 and summary["kills"] > 0
    failed = [describe(r) for r in results if r.violations]
    assert failed == [], "\n".join(failed)


def test_a_redriven_message_is_excused_only_when_every_receive_was_answered_with_a_delete() -> None:
    received = {"r1": "done", "r2": "done", "r3": "forgotten", "r4": "forgotten", "r5": "clean"}
    deletes = {"r1": ["fail_503"], "r2": ["lose_response"], "r3": ["fail_503"], "r5": ["forward"]}
    dlq = ["done", "forgotten", "clean", "a-record"]
    # "done": each receive deleted, the deletes refused or lost -> SQS's redrive, excused.
    # "forgotten": r4 was never deleted (a worker that leaves a message behind) -> held against it.
    # "clean": its delete went through, so SQS did not move it for lack of one -> held.
    # "a-record": never received, so a worker sent it (a dead-letter record): judged as before.
    assert redriven_messages(received, deletes, dlq) == ["done"]
