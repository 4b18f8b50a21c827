"""The README is a landing page and docs/ holds the topics: every relative link and ``#anchor`` in
them resolves, every docs page is reachable from the README and links back to it, and the README
stays a page a newcomer reads to the end.

Anchors are GitHub's: a heading's text, lower-cased, stripped of everything but letters, digits,
``_``, ``-`` and spaces, spaces turned into ``-``, and a second heading of the same text ``-1``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS, ROOT / "infra" / "README.md"]
README_MAX_LINES = 250

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks (a ``#`` comment in a shell block is no heading)."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(path):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """Every link target in the file's prose, paragraph by paragraph (a code span or a link's text
    may go on over a line break), inline code and code blocks left out."""
    paragraphs = "\n".join(prose(path)).split("\n\n")
    return [
        target
        for paragraph in paragraphs
        for target in _LINK.findall(_CODE_SPAN.sub("", paragraph))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


def resolved(page: Path, target: str) -> tuple[Path, str]:
    where, _, anchor = target.partition("#")
    return ((page.parent / where).resolve() if where else page), anchor


def test_slugs_are_githubs() -> None:
    assert slug("Many options (27 to 255)") == "many-options-27-to-255"
    assert slug("TypeSafe System One (`/v1/systemone`)") == "typesafe-system-one-v1systemone"
    assert slug("Batch jobs: S3 drop -> SQS -> worker pool -> S3") == (
        "batch-jobs-s3-drop---sqs---worker-pool---s3"
    )
    assert slug("Against llama.cpp's own server (`arbiter bench peers`)") == (
        "against-llamacpps-own-server-arbiter-bench-peers"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        path, anchor = resolved(page, target)
        if not path.exists():
            broken.append(f"{target}: no {path.relative_to(ROOT)}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert broken == []


def test_every_docs_page_is_linked_from_the_readme() -> None:
    reached = {resolved(README, target)[0] for target in links(README)}
    assert [str(p.relative_to(ROOT)) for p in DOCS if p.resolve() not in reached] == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_docs_page_starts_with_its_title_and_links_back_to_the_readme(page: Path) -> None:
    assert page.read_text().startswith("# ")
    assert README.resolve() in {resolved(page, target)[0] for target in links(page)}


def test_the_readme_is_a_landing_page() -> None:
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_bench_all_rewrites_its_section_in_the_performance_page() -> None:
    """`arbiter bench all --readme docs/performance.md` replaces the text between its markers: they
    are there once, in that page and no other."""
    from bench.all_bench import README_END, README_START

    holding = [
        str(p.relative_to(ROOT))
        for p in (README, *DOCS)
        if README_START in p.read_text() or README_END in p.read_text()
    ]
    assert holding == ["docs/performance.md"]
    text = (ROOT / "docs" / "performance.md").read_text()
    assert text.count(README_START) == text.count(README_END) == 1
    assert text.index(README_START) < text.index(README_END)


def _count(seeds: str) -> int:
    start, stop = seeds.split(":")
    return int(stop) - int(start)


def _stated(pattern: str, path: Path) -> list[int]:
    text = " ".join(path.read_text().split())
    match = re.search(pattern, text)
    assert match, f"{path.relative_to(ROOT)} no longer says {pattern!r}"
    return [int(g.replace(",", "")) for g in match.groups()]


def test_the_fault_campaigns_seed_counts_are_the_same_everywhere() -> None:
    """What each target runs of the seeded fault campaign, as the Makefile, .ci/run and
    tests/worker/test_campaign.py set it, is what the Makefile's and .ci/run's comments and
    docs/batch-jobs.md say (they said 24, 24 and 30 seeds where 12 and 20 ran)."""
    makefile, ci = ROOT / "Makefile", ROOT / ".ci" / "run"
    campaign = (ROOT / "tests" / "worker" / "test_campaign.py").read_text()
    [in_test] = re.findall(r'"ARBITER_CAMPAIGN_SEEDS", "(\d+:\d+)"', campaign)
    [faults] = re.findall(r"^FAULT_SEEDS \?= (\d+:\d+)$", makefile.read_text(), re.M)
    [fuzz] = re.findall(r"^FUZZ_FAULT_SEEDS \?= (\d+:\d+)$", makefile.read_text(), re.M)
    [in_ci] = re.findall(r"make faults FAULT_SEEDS=(\d+:\d+)", ci.read_text())
    test, faults_n, fuzz_n, ci_n = (_count(s) for s in (in_test, faults, fuzz, in_ci))
    page = ROOT / "docs" / "batch-jobs.md"
    assert _stated(r"`make test` runs (\d+) seeds", page) == [test]
    assert _stated(r"`make faults` ([\d,]+) and the black-box", page) == [faults_n]
    assert _stated(r"`make fuzz` ([\d,]+); CI runs ([\d,]+)", page) == [fuzz_n, ci_n]
    assert _stated(r"make test runs (\d+) of its seeds, make fuzz ([\d,]+)", makefile) == [
        test,
        fuzz_n,
    ]
    assert _stated(r"\((\d+) seeds, make test runs (\d+) others\)", ci) == [ci_n, test]
