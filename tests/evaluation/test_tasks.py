"""Task files for eval/calibrate: Arbiter's own format and the JevBench format (all three types)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arbiter import systemone
from evaluation.tasks import TaskFileError, load, parse_record
from tests import DATA, EXAMPLES


def _options(item: object) -> list[tuple[str, str]]:
    return [(o.id, o.description) for o in item.request.options]  # type: ignore[attr-defined]


def test_jevbench_file_maps_every_type() -> None:
    items = {i.id: i for i in load([DATA / "jevbench-mini.jsonl"])}
    assert len(items) == 6

    noul = items["jb-noul-1"]
    assert _options(noul) == [("true", "Yes"), ("false", "No")]  # default criteria
    assert (noul.label, noul.label_index, noul.question_type) == ("true", 0, "noul")
    assert noul.request.question == "Is this ticket about account access?"
    noul2 = items["jb-noul-2"]
    assert noul2.label == "false"
    assert _options(noul2)[0] == ("true", "Yes, a refund is requested")
    assert (
        noul2.request.question == '{"ask": "Is the customer asking for a refund?"}'
    )  # JSON-encoded

    choice = items["jb-choice-1"]  # criteria keys reordered by "labels"
    assert [o for o, _ in _options(choice)] == ["identity", "billing", "shipping"]
    assert _options(choice)[0] == ("identity", "identity: Sign-in and passwords")
    assert _options(choice)[2] == ("shipping", "shipping")  # no description
    assert (choice.label, choice.label_index) == ("identity", 0)
    listed = items["jb-choice-2"]  # criteria as a list, named by labels
    assert _options(listed) == [
        ("returns", "returns: Returns and refunds"),
        ("sales", "sales: New sales"),
    ]

    score = items["jb-score-1"]
    assert _options(score) == [("0", "Not urgent"), ("1", "Somewhat urgent"), ("2", "Very urgent")]
    assert (score.label, score.question_type) == ("1", "score")
    assert items["jb-score-2"].label == "1"  # a level text listed in labels

    assert (noul.tier, noul.family, noul.split) == ("easy", "easy-support", "test")
    assert choice.tier == "hard"


def test_jevbench_mapping_is_the_systemone_mapping() -> None:
    """The eval measures what POST /v1/systemone answers: same decisions, same question_type."""
    record = json.loads((DATA / "jevbench-mini.jsonl").read_text().splitlines()[2])
    item = parse_record(record, "x.jsonl")
    question = dict(record["question"])
    question["criteria"] = {k: question["criteria"][k] for k in record["labels"]}
    served = systemone.to_decisions(
        systemone.parse_request(
            {"model": "m", "state": record["state"], "questions": {record["id"]: question}}
        )
    )[0]
    assert served == item.request
    assert served.question_type == "choice"


def test_arbiter_format_with_metadata() -> None:
    items = load([EXAMPLES / "labeled.jsonl"])
    assert len(items) == 36
    assert all(i.label in [o.id for o in i.request.options] for i in items)
    item = parse_record(
        {
            "id": "a",
            "state": "s",
            "question": "q?",
            "options": [{"id": "x", "description": "X"}, {"id": "y", "description": "Y"}],
            "label": "y",
            "tier": "hard",
            "family": "routing",
        },
        "f.jsonl",
    )
    assert (item.label_index, item.tier, item.family, item.question_type) == (
        1,
        "hard",
        "routing",
        "decision",
    )


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"id": "a", "state": "s", "question": "q", "options": []}, "label"),
        (
            {
                "id": "a",
                "state": "s",
                "question": "q",
                "options": [{"id": "x", "description": "X"}, {"id": "y", "description": "Y"}],
                "label": "z",
            },
            "not one of the option ids",
        ),
        (
            {"id": "n", "state": "s", "question": {"type": "noul"}, "expected": "maybe"},
            '"yes" or "no"',
        ),
        (
            {
                "id": "c",
                "state": "s",
                "question": {"type": "choice", "criteria": {"a": "A", "b": "B"}},
                "expected": "c",
            },
            "not a choice criteria key",
        ),
        (
            {
                "id": "c",
                "state": "s",
                "question": {"type": "choice", "criteria": {"a": "A", "b": "B"}},
                "labels": ["a", "z"],
                "expected": "a",
            },
            "criteria keys",
        ),
        (
            {
                "id": "s",
                "state": "s",
                "question": {"type": "score", "criteria": ["lo", "hi"]},
                "expected": 2,
            },
            "outside 0..1",
        ),
        ({"id": "t", "state": "s", "question": {"type": "rank"}, "expected": "a"}, "not noul"),
    ],
)
def test_bad_records_are_refused(record: dict[str, object], message: str) -> None:
    with pytest.raises(TaskFileError, match=message):
        parse_record(record, "f.jsonl")


def test_load_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = (DATA / "labeled-mini.jsonl").read_text().splitlines()[0]
    path.write_text(good + "\n\n{not json\n")
    with pytest.raises(TaskFileError, match=r"t\.jsonl:3: not valid JSON"):
        load([path])
    path.write_text(good + "\n" + good + "\n")
    with pytest.raises(TaskFileError, match="duplicate id"):
        load([path])
