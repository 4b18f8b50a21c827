"""docs/development.md lists the steps `.ci/run` runs, in its order, word for word: the page said
`.ci/run` ran three targets while it ran seven, and named a count of mutations long after it
changed. The script is the truth; this holds the page to it."""

from __future__ import annotations

import re

from tests import ROOT


def _ci_steps() -> list[str]:
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    return [m.group(1).strip() for m in re.finditer(r"^step (.+)$", script, re.MULTILINE)]


def _documented_steps() -> list[str]:
    page = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    section = page.split("## What CI runs", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`$", section, re.MULTILINE)


def test_the_development_page_lists_what_ci_runs_in_its_order() -> None:
    steps = _ci_steps()
    assert len(steps) >= 5, steps  # the script's own shape: a step per line
    assert _documented_steps() == steps


def test_each_ci_target_is_described_on_the_page() -> None:
    page = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    for step in _ci_steps():
        target = " ".join(step.split()[:2])  # `make soak`
        assert f"- `{target}`" in page, target


def test_the_page_states_no_count_of_mutations() -> None:
    # How many there are is `scripts/mutate.py --list`'s to say; a count here goes stale.
    page = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    assert not re.search(r"\b\d+ (of them|mutations)\b", page)
