"""`arbiter transform` with ``DataProcessing``: the outputs SageMaker's "Associate Prediction Results
with Input Records" guide documents (its join of ``{"key":1}`` and ``{"label":1}``, its ID example
with ``InputFilter="$.features"`` and ``OutputFilter="$['id','SageMakerOutput']"``, a record that is
not an object), the real container behind an InputFilter and a join, and SageMaker's JSONPath
subset: every example the guide and the API reference give is accepted, what is outside refused
before anything runs."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from arbiter.cli import main
from emulator.dataprocessing import compile_filter
from infra.transform import TransformError
from tests.emulator.support import BUCKET, container, stand_in
from tests.emulator.test_transform import IN, direct, essentials, transform
from tests.fakes import decision_line

pytestmark = pytest.mark.timeout(300)
MULTI = ("--batch-strategy", "MultiRecord")


def labels(request_lines: list[bytes]) -> bytes:
    """What the stand-in answers: one {"label": <the record's length>} per record sent."""
    return b"".join(b'{"label":%d}\n' % len(json.loads(line)) for line in request_lines)


def labeller(fake: Any) -> None:
    async def respond(request: web.Request) -> web.Response:
        return web.Response(body=labels((await request.read()).splitlines()))

    fake.respond = respond


def out_records(s3: Any, name: str) -> list[Any]:
    body = s3.get_object(Bucket=BUCKET, Key=f"transform/out/{name}.out")["Body"].read()
    return [json.loads(line) for line in body.splitlines()]


def test_join_source_input_adds_the_answer_as_sagemaker_output(local_s3: Any, capsys: Any) -> None:
    """The guide: input {"key":1}, result {"label":1}: the output is {"key":1,"SageMakerOutput":
    {"label":1}}; a record that is not an object is wrapped as SageMakerInput."""
    local_s3.put_object(
        Bucket=BUCKET, Key="transform/in/a.jsonl", Body=b'{"key":1}\n\n[1,2,3]\n"text"\n'
    )
    with stand_in() as (fake, url):
        labeller(fake)
        code, summary = transform(capsys, "--container-url", url, "--join-source", "Input", *MULTI)
    assert code == 0, summary
    assert out_records(local_s3, "a.jsonl") == [
        {"key": 1, "SageMakerOutput": {"label": 1}},
        {"SageMakerInput": [1, 2, 3], "SageMakerOutput": {"label": 3}},
        {"SageMakerInput": "text", "SageMakerOutput": {"label": 4}},
    ]
    assert fake.seen[0]["body"] == b'{"key":1}\n[1,2,3]\n"text"\n'  # the records, no blank line


def test_the_guides_id_example_filters_in_and_out(local_s3: Any, capsys: Any) -> None:
    """InputFilter "$.features" (the container gets only the features), JoinSource Input,
    OutputFilter "$['id','SageMakerOutput']": each output is the id and the answer."""
    records = [{"id": f"r{n}", "features": [n] * (n + 1), "note": "x"} for n in range(3)]
    body = "".join(json.dumps(r) + "\n" for r in records).encode()
    local_s3.put_object(Bucket=BUCKET, Key="transform/in/a.jsonl", Body=body)
    with stand_in() as (fake, url):
        labeller(fake)
        code, summary = transform(
            capsys,
            "--container-url",
            url,
            "--batch-strategy",
            "SingleRecord",
            "--max-concurrent-transforms",
            "2",
            "--input-filter",
            "$.features",
            "--join-source",
            "Input",
            "--output-filter",
            "$['id','SageMakerOutput']",
        )
    assert code == 0, summary
    assert sorted(s["body"] for s in fake.seen) == [b"[0]\n", b"[1,1]\n", b"[2,2,2]\n"]
    assert out_records(local_s3, "a.jsonl") == [
        {"id": f"r{n}", "SageMakerOutput": {"label": n + 1}} for n in range(3)
    ]


def test_an_output_filter_without_a_join_selects_from_the_answer(
    local_s3: Any, capsys: Any
) -> None:
    local_s3.put_object(Bucket=BUCKET, Key="transform/in/a.jsonl", Body=b'{"a":1}\n{"b":2,"c":3}\n')
    with stand_in() as (fake, url):
        labeller(fake)
        code, summary = transform(capsys, "--container-url", url, "--output-filter", "$.label")
    assert code == 0, summary
    assert out_records(local_s3, "a.jsonl") == [1, 2]


def test_an_answer_short_of_a_line_per_record_fails_the_object(local_s3: Any, capsys: Any) -> None:
    local_s3.put_object(Bucket=BUCKET, Key="transform/in/a.jsonl", Body=b'{"a":1}\n{"b":2}\n')
    with stand_in() as (fake, url):

        async def one_line(request: web.Request) -> web.Response:
            return web.Response(body=b'{"label":0}\n')

        fake.respond = one_line
        code, summary = transform(capsys, "--container-url", url, "--join-source", "Input", *MULTI)
    assert code == 1
    assert "answered 1 lines for records 1-2" in summary["FailureReason"], summary
    assert "Contents" not in local_s3.list_objects_v2(Bucket=BUCKET, Prefix="transform/out/")


def test_a_record_that_is_not_json_fails_its_object_naming_it(local_s3: Any, capsys: Any) -> None:
    local_s3.put_object(Bucket=BUCKET, Key="transform/in/a.jsonl", Body=b'{"a":1}\nnot json\n')
    with stand_in() as (fake, url):
        labeller(fake)
        code, summary = transform(capsys, "--container-url", url, "--input-filter", "$.a")
    assert code == 1
    assert "input record of record 2 is not JSON" in summary["FailureReason"], summary


@pytest.mark.real_model
def test_the_real_container_behind_an_input_filter_and_a_join(
    engine: Any, local_s3: Any, capsys: Any
) -> None:
    """Records carry a ticket id beside the decision; the container is sent only the decision
    ($.decision) and each output is the ticket and Arbiter's answer, as it answers directly."""
    decisions = [decision_line(i) for i in range(3)]
    body = "".join(
        json.dumps({"ticket": f"T-{i}", "decision": json.loads(d)}) + "\n"
        for i, d in enumerate(decisions)
    )
    local_s3.put_object(Bucket=BUCKET, Key="transform/in/tickets.jsonl", Body=body.encode())
    with container(engine, batch_max_payload_mb=6) as url:
        code, summary = transform(
            capsys,
            "--container-url",
            url,
            "--input-filter",
            "$.decision",
            "--join-source",
            "Input",
            "--output-filter",
            "$['ticket','SageMakerOutput']",
        )
        sent = "".join(json.dumps(json.loads(d), separators=(",", ":")) + "\n" for d in decisions)
        answers = direct(url, sent.encode()).splitlines()
    assert code == 0, summary
    out = out_records(local_s3, "tickets.jsonl")
    assert [sorted(r) for r in out] == [["SageMakerOutput", "ticket"]] * 3
    assert [r["ticket"] for r in out] == ["T-0", "T-1", "T-2"]
    assert [essentials(json.dumps(r["SageMakerOutput"])) for r in out] == [
        essentials(a) for a in answers
    ]


# -- SageMaker's JSONPath subset ---------------------------------------------------------------

DATA = {"id": "r1", "features": [10, 11, 12, 13, 14, 15, 16], "field1": {"child1": 1, "child2": 2}}
ROW = [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        # the guide's operator table and the API reference's examples, all of them
        ("$", DATA, DATA),
        ("$.id", DATA, "r1"),
        ("$.features", DATA, DATA["features"]),
        ("$.field1.*", DATA, [1, 2]),
        ("$['id','features']", DATA, {"id": "r1", "features": DATA["features"]}),
        ("$['id','nothing']", DATA, {"id": "r1"}),
        ("$.field1.['child1','child2']", DATA, {"child1": 1, "child2": 2}),
        ("$[1]", ROW, 1),
        ("$[1,3,5]", ROW, [1, 3, 5]),
        ("$[-1]", ROW, 6),
        ("$[2:5]", ROW, [2, 3, 4]),
        ("$[:5]", ROW, [0, 1, 2, 3, 4]),
        ("$[2:]", ROW, [2, 3, 4, 5, 6]),
        ("$[1:]", ROW, [1, 2, 3, 4, 5, 6]),
        ("$[0,5:]", ROW, [0, 5, 6]),
        ("$.features[0]", DATA, 10),
    ],
)
def test_sagemakers_jsonpath_operators_are_accepted(path: str, value: Any, expected: Any) -> None:
    assert compile_filter("InputFilter", path).apply(value) == expected


@pytest.mark.parametrize(
    "path", ["$..id", "$[?(@.a > 1)]", "$[::2]", "id", "$.a | $.b", "$[", "$.a[~]"]
)
def test_what_is_outside_the_subset_is_refused(path: str) -> None:
    with pytest.raises(TransformError, match="SageMaker's JSONPath subset"):
        compile_filter("InputFilter", path)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--input-filter", "$..id"], "recursive descent"),
        (["--join-source", "Input", "--split-type", "None"], "SplitType=Line"),
        (["--join-source", "Input", "--content-type", "text/csv"], "text/csv is not built"),
        (["--output-filter", "$." + "a" * 62], "at most 63 characters"),
    ],
)
def test_a_job_this_cannot_run_is_refused_before_anything_runs(
    capsys: Any, args: list[str], said: str
) -> None:
    code = main(["transform", IN, f"s3://{BUCKET}/transform/out/", *args])
    err = capsys.readouterr().err
    assert code == 2 and said in err, err


def test_the_dry_run_sends_data_processing(capsys: Any) -> None:
    code, printed = transform(
        capsys,
        "--aws",
        "--dry-run",
        "--model-name",
        "m",
        "--input-filter",
        "$.features",
        "--join-source",
        "Input",
    )
    job = json.loads(printed.splitlines()[0])["params"]
    assert code == 0
    assert job["DataProcessing"] == {"InputFilter": "$.features", "JoinSource": "Input"}
