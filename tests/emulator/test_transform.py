"""`arbiter transform`: a Batch Transform job's data plane over the local S3 (three objects, one with
a bad line, one split into several mini-batches, each .out line for line and equal to what the
container answers), its failure rules and concurrency, and ``--aws``: a CreateTransformJob that
moto's SageMaker accepts."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import pytest
from aiohttp import web

from arbiter.cli import main
from tests.emulator.support import BUCKET, aws, container, stand_in
from tests.fakes import FakeEngine, decision_line

pytestmark = pytest.mark.timeout(300)
IN, OUT = f"s3://{BUCKET}/transform/in/", f"s3://{BUCKET}/transform/out/"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/arbiter@sha256:" + "a" * 64


def transform(capsys: Any, *args: str) -> tuple[int, Any]:
    """Run the command; its exit status and the job summary it printed (or the plan's lines).
    The in-process container logs to the same stdout, so the summary is found, not assumed."""
    code = main(["transform", IN, OUT, *args])
    out = capsys.readouterr().out
    start = out.find("{\n")
    if start >= 0:
        return code, json.JSONDecoder().raw_decode(out[start:])[0]
    return code, "\n".join(line for line in out.splitlines() if line.startswith('{"step"'))


def essentials(line: bytes) -> Any:
    record = json.loads(line)
    if "error" in record:
        return record["id"], record["error"]["code"]
    return record["id"], record["result"]["option_ids"], record["result"]["probabilities"]


def direct(url: str, body: bytes) -> bytes:
    request = urllib.request.Request(
        url + "/invocations", body, {"Content-Type": "application/jsonlines"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        data: bytes = response.read()
    return data


def padded(i: int, pad: int) -> str:
    """Decision d<i> as a line of ``pad`` more bytes (whitespace: the same decision, bigger)."""
    return "{" + " " * pad + decision_line(i)[1:]


@pytest.mark.real_model
def test_three_objects_become_three_out_objects_line_for_line(
    engine: Any, local_s3: Any, capsys: Any
) -> None:
    inputs = {
        "plain.jsonl": "\n".join(decision_line(i) for i in range(3)) + "\n",
        "bad-line.jsonl": f"{decision_line(10)}\nnot json at all\n{decision_line(11)}\n",
        "large.jsonl": "\n".join(padded(20 + i, 600_000) for i in range(3)) + "\n",
    }
    for name, body in inputs.items():
        local_s3.put_object(Bucket=BUCKET, Key=f"transform/in/{name}", Body=body.encode())
    with container(engine, batch_max_payload_mb=6) as url:
        code, summary = transform(capsys, "--max-payload-mb", "1", "--container-url", url)
        answers = {name: direct(url, body.encode()) for name, body in inputs.items()}
    assert code == 0 and summary["TransformJobStatus"] == "Completed", summary
    assert summary["BatchStrategy"] == "MultiRecord"  # the container's /execution-parameters
    batches = {o["input"].rsplit("/", 1)[1]: o["mini_batches"] for o in summary["Objects"]}
    assert batches == {"plain.jsonl": 1, "bad-line.jsonl": 1, "large.jsonl": 3}
    for name, body in inputs.items():
        out = local_s3.get_object(Bucket=BUCKET, Key=f"transform/out/{name}.out")["Body"].read()
        lines = out.splitlines()
        assert len(lines) == len(body.splitlines())  # line for line
        assert [essentials(x) for x in lines] == [essentials(x) for x in answers[name].splitlines()]
    bad = local_s3.get_object(Bucket=BUCKET, Key="transform/out/bad-line.jsonl.out")["Body"].read()
    assert [essentials(x)[0] for x in bad.splitlines()] == ["d10", None, "d11"]
    plain = local_s3.get_object(Bucket=BUCKET, Key="transform/out/plain.jsonl.out")["Body"].read()
    ours = [json.loads(x) for x in plain.splitlines()]
    theirs = [json.loads(x) for x in answers["plain.jsonl"].splitlines()]
    assert [r["line"] for r in ours] == [r["line"] for r in theirs] == [1, 2, 3]


def test_concurrency_is_bounded_and_values_come_from_execution_parameters(
    local_s3: Any, capsys: Any
) -> None:
    for n in range(4):
        local_s3.put_object(Bucket=BUCKET, Key=f"transform/in/{n}.jsonl", Body=b"a\nb\nc\n")
    with stand_in() as (fake, url):
        fake.execution = {
            "MaxConcurrentTransforms": 2,
            "BatchStrategy": "SINGLE_RECORD",
            "MaxPayloadInMB": 6,
        }

        async def echo(request: web.Request) -> web.Response:
            record = (await request.read()).strip()  # read() is cached: the body it was sent
            await asyncio.sleep(0.05)
            return web.Response(body=b"<" + record + b">")

        fake.respond = echo
        code, summary = transform(capsys, "--container-url", url)
    assert code == 0, summary
    assert (summary["MaxConcurrentTransforms"], summary["BatchStrategy"]) == (2, "SingleRecord")
    assert fake.most_active == 2 and len(fake.seen) == 12  # one record per request
    out = local_s3.get_object(Bucket=BUCKET, Key="transform/out/2.jsonl.out")["Body"].read()
    assert out == b"<a>\n<b>\n<c>\n"  # in input order, a newline after each (AssembleWith=Line)


def test_a_server_error_is_retried_and_a_refusal_fails_the_job(local_s3: Any, capsys: Any) -> None:
    local_s3.put_object(Bucket=BUCKET, Key="transform/in/a.jsonl", Body=b"x\n")
    with stand_in() as (fake, url):
        answers = iter([503, 500, 200])

        async def flaky(request: web.Request) -> web.Response:
            return web.Response(status=next(answers), body=b"ok")

        fake.respond = flaky
        code, summary = transform(capsys, "--container-url", url)
        assert code == 0 and len(fake.seen) == 3, summary

        local_s3.put_object(Bucket=BUCKET, Key="transform/in/b.jsonl", Body=b"y\n")

        async def refuse(request: web.Request) -> web.Response:
            status = 415 if await request.read() == b"y\n" else 200
            return web.Response(status=status, body=b"no")

        fake.respond = refuse
        fake.seen.clear()
        code, summary = transform(
            capsys, "--container-url", url, "--max-concurrent-transforms", "1"
        )
    assert code == 1 and summary["TransformJobStatus"] == "Failed"
    assert "415" in summary["FailureReason"]
    assert len([s for s in fake.seen if s["body"] == b"y\n"]) == 1  # a 4xx is not retried
    keys = {
        o["Key"]
        for o in local_s3.list_objects_v2(Bucket=BUCKET, Prefix="transform/out/")["Contents"]
    }
    assert "transform/out/b.jsonl.out" not in keys and "transform/out/a.jsonl.out" in keys


def test_a_record_over_max_payload_fails_the_job(local_s3: Any, capsys: Any) -> None:
    local_s3.put_object(
        Bucket=BUCKET,
        Key="transform/in/big.jsonl",
        Body=b"small\n" + b"x" * (1024 * 1024 + 1) + b"\n",
    )
    with stand_in() as (_fake, url):
        code, summary = transform(capsys, "--container-url", url, "--max-payload-mb", "1")
    assert code == 1 and "over MaxPayloadInMB" in summary["FailureReason"]
    assert "Contents" not in local_s3.list_objects_v2(Bucket=BUCKET, Prefix="transform/out/")


def test_aws_dry_run_prints_a_create_transform_job_that_moto_accepts(
    endpoint: str, capsys: Any
) -> None:
    args = [
        "--aws",
        "--dry-run",
        "--job-name",
        "nightly-1",
        "--image",
        IMAGE,
        "--model-data",
        f"s3://{BUCKET}/models/abc/model.tar.gz",
        "--role",
        "arn:aws:iam::123456789012:role/transform",
        "--max-payload-mb",
        "2",
    ]
    code, printed = transform(capsys, *args)
    assert code == 0
    calls = [json.loads(line) for line in printed.splitlines()]
    assert [c["operation"] for c in calls] == [
        "create_model",
        "create_transform_job",
        "describe_transform_job",
    ]
    model, job = calls[0]["params"], calls[1]["params"]
    assert model["PrimaryContainer"]["Image"] == IMAGE
    assert job["ModelName"] == model["ModelName"] and job["MaxPayloadInMB"] == 2
    assert job["TransformInput"]["SplitType"] == "Line"
    assert job["TransformOutput"] == {
        "S3OutputPath": OUT,
        "Accept": "application/jsonlines",
        "AssembleWith": "Line",
    }
    assert job["Environment"]["ARBITER_BATCH_INVOCATION_TIMEOUT_S"] == "600"
    sagemaker = aws("sagemaker", endpoint)
    sagemaker.create_model(**model)
    sagemaker.create_transform_job(**job)
    found = sagemaker.describe_transform_job(TransformJobName="nightly-1")
    assert found["ModelName"] == model["ModelName"] and found["MaxPayloadInMB"] == 2


def test_aws_creates_the_job_and_reuses_its_model(
    endpoint: str, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    base = [
        "--aws",
        "--endpoint-url",
        endpoint,
        "--image",
        IMAGE,
        "--model-data",
        f"s3://{BUCKET}/models/abc/model.tar.gz",
        "--role",
        "arn:aws:iam::123456789012:role/transform",
    ]
    first = transform(capsys, *base, "--job-name", "run-1")
    second = transform(capsys, *base, "--job-name", "run-2")
    assert first[0] == second[0] == 0
    assert first[1]["ModelName"] == second[1]["ModelName"]
    assert len(aws("sagemaker", endpoint).list_models()["Models"]) == 1


def test_a_tag_is_refused_before_any_call(capsys: Any) -> None:
    code = main(
        [
            "transform",
            IN,
            OUT,
            "--aws",
            "--dry-run",
            "--image",
            "repo/arbiter:latest",
            "--model-data",
            f"s3://{BUCKET}/m.tar.gz",
            "--role",
            "arn:aws:iam::1:role/r",
        ]
    )
    assert code == 2 and "not pinned by digest" in capsys.readouterr().err


def test_objects_are_independent_one_failing_does_not_stop_the_others(
    local_s3: Any, capsys: Any
) -> None:
    """Three objects, the container refusing one (415): the other two outputs are uploaded, as
    AWS uploads them; the job fails, naming the object that failed."""
    for name in ("a", "b", "c"):
        local_s3.put_object(Bucket=BUCKET, Key=f"transform/in/{name}.jsonl", Body=f"{name}\n")
    with stand_in() as (fake, url):

        async def refuse_b(request: web.Request) -> web.Response:
            body = await request.read()
            await asyncio.sleep(0.3 if body == b"a\n" else 0)  # a is still running when b fails
            return web.Response(status=415 if body == b"b\n" else 200, body=body.upper())

        fake.respond = refuse_b
        code, summary = transform(
            capsys, "--container-url", url, "--max-concurrent-transforms", "3"
        )
    assert code == 1 and summary["TransformJobStatus"] == "Failed"
    assert "415" in summary["FailureReason"]
    assert [f["input"] for f in summary["FailedObjects"]] == [f"{IN}b.jsonl"]
    keys = {
        o["Key"]
        for o in local_s3.list_objects_v2(Bucket=BUCKET, Prefix="transform/out/")["Contents"]
    }
    assert keys == {"transform/out/a.jsonl.out", "transform/out/c.jsonl.out"}
    got = local_s3.get_object(Bucket=BUCKET, Key="transform/out/a.jsonl.out")["Body"].read()
    assert got == b"A\n"


def test_max_concurrent_transforms_0_takes_the_containers(local_s3: Any, capsys: Any) -> None:
    local_s3.put_object(Bucket=BUCKET, Key="transform/in/a.jsonl", Body=b"a\n")
    with stand_in() as (fake, url):
        fake.execution = {"MaxConcurrentTransforms": 3, "BatchStrategy": "MULTI_RECORD"}
        code, summary = transform(
            capsys, "--container-url", url, "--max-concurrent-transforms", "0"
        )
    assert code == 0, summary
    assert summary["MaxConcurrentTransforms"] == 3


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--instance-type", "ml.bogus.huge", "ml.bogus.huge"),
        ("--instance-count", "0", "InstanceCount"),
    ],
)
def test_the_dry_run_refuses_what_sagemakers_model_refuses(
    capsys: Any, flag: str, value: str, said: str
) -> None:
    code = main(["transform", IN, OUT, "--aws", "--dry-run", "--model-name", "m", flag, value])
    err = capsys.readouterr().err
    assert code == 2 and said in err and "refused" in err


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--model-name", "my_model"], "'my_model' does not match"),
        (
            [
                *("--image", IMAGE),
                *("--model-data", "s3://b/m.tar.gz", "--role", "arn:aws:iam::123:role/r"),
            ],
            "'arn:aws:iam::123:role/r' does not match",
        ),
        (["--model-name", "m", "--content-type", "text/csv\nX-Injected: 1"], "ContentType"),
        (["--model-name", "m", "--content-type", "text/csv\rX"], "ContentType"),
    ],
    ids=["model name", "3-digit account", "newline in a content type", "carriage return"],
)
def test_the_dry_run_refuses_what_sagemakers_patterns_refuse(
    capsys: Any, extra: list[str], said: str
) -> None:
    """Issue 37 item 14: the model's patterns, as AWS applies them (the whole value; Java's `.`
    matches no newline), were skipped: all three passed the dry run."""
    code = main(["transform", IN, OUT, "--aws", "--dry-run", *extra])
    captured = capsys.readouterr()
    assert code == 2 and said in captured.err and "refused" in captured.err
    assert captured.out == ""  # nothing printed as a plan


def test_the_containers_payload_is_sized_to_the_jobs_timeout(local_s3: Any, capsys: Any) -> None:
    """The running container (its own ARBITER_BATCH_INVOCATION_TIMEOUT_S 600 s) offers the
    MaxPayloadInMB that fits the job's InvocationsTimeoutInSeconds, as a container started with the
    job's Environment does on AWS: an hour's job gets larger mini-batches."""
    local_s3.put_object(Bucket=BUCKET, Key="transform/in/a.jsonl", Body=b"a\n")
    offered = {}
    with container(FakeEngine(delay_s=0.2), batch_invocation_timeout_s=600) as url:
        for timeout in ("600", "3600"):
            code, summary = transform(
                capsys, "--container-url", url, "--invocations-timeout", timeout
            )
            assert code == 0, summary
            offered[timeout] = summary["MaxPayloadInMB"]
    assert offered["600"] == 1 and offered["3600"] > 1, offered


def test_a_manifest_file_names_the_objects_to_transform(local_s3: Any, capsys: Any) -> None:
    """S3DataType=ManifestFile: the manifest's prefix followed by each path is an input (and only
    those: a sibling object is not); each .out is named by its path relative to the prefix."""
    objects = {"day-1/a.jsonl": b"a\n", "day-2/b.jsonl": b"b\n", "day-2/skipped.jsonl": b"s\n"}
    for path, body in objects.items():
        local_s3.put_object(Bucket=BUCKET, Key=f"transform/data/{path}", Body=body)
    manifest = [{"prefix": f"s3://{BUCKET}/transform/data/"}, "day-1/a.jsonl", "day-2/b.jsonl"]
    local_s3.put_object(
        Bucket=BUCKET, Key="transform/jobs/nightly.manifest", Body=json.dumps(manifest).encode()
    )
    with stand_in() as (fake, url):

        async def upper(request: web.Request) -> web.Response:
            return web.Response(body=(await request.read()).upper())

        fake.respond = upper
        code = main(
            [
                "transform",
                f"s3://{BUCKET}/transform/jobs/nightly.manifest",
                OUT,
                "--data-type",
                "ManifestFile",
                "--container-url",
                url,
            ]
        )
    out = capsys.readouterr().out
    summary = json.JSONDecoder().raw_decode(out[out.find("{\n") :])[0]
    assert code == 0, summary
    assert sorted(s["body"] for s in fake.seen) == [b"a\n", b"b\n"]
    keys = sorted(
        o["Key"]
        for o in local_s3.list_objects_v2(Bucket=BUCKET, Prefix="transform/out/")["Contents"]
    )
    assert keys == ["transform/out/day-1/a.jsonl.out", "transform/out/day-2/b.jsonl.out"]
    got = local_s3.get_object(Bucket=BUCKET, Key="transform/out/day-2/b.jsonl.out")["Body"].read()
    assert got == b"B\n"


@pytest.mark.parametrize(
    ("manifest", "said"),
    [
        (b"not json", "is not JSON"),
        (b'["day-1/a.jsonl"]', 'first element is {"prefix"'),
        (b'[{"prefix": "s3://b/p/"}, 3]', "element 1 is not a path"),
        (b'[{"prefix": "s3://b/p/"}]', "no input objects in the manifest"),
    ],
)
def test_a_bad_manifest_fails_the_job_saying_why(
    local_s3: Any, capsys: Any, manifest: bytes, said: str
) -> None:
    local_s3.put_object(Bucket=BUCKET, Key="transform/m.manifest", Body=manifest)
    with stand_in() as (fake, url):
        code = main(
            [
                "transform",
                f"s3://{BUCKET}/transform/m.manifest",
                OUT,
                "--data-type",
                "ManifestFile",
                "--container-url",
                url,
            ]
        )
    out = capsys.readouterr().out
    summary = json.JSONDecoder().raw_decode(out[out.find("{\n") :])[0]
    assert code == 1 and said in summary["FailureReason"], summary
    assert fake.seen == []


def test_augmented_manifest_file_is_refused_as_sagemaker_documents(capsys: Any) -> None:
    """TransformS3DataSource: "The following value is not compatible: AugmentedManifestFile";
    refused before anything runs, locally and for --aws alike."""
    for extra in ([], ["--aws", "--dry-run", "--model-name", "m"]):
        code = main(["transform", IN, OUT, "--data-type", "AugmentedManifestFile", *extra])
        err = capsys.readouterr().err
        assert code == 2 and "not compatible with batch transform" in err, err


def test_aws_dry_run_sends_the_manifest_data_type(capsys: Any) -> None:
    code, printed = transform(
        capsys, "--aws", "--dry-run", "--model-name", "m", "--data-type", "ManifestFile"
    )
    job = json.loads(printed.splitlines()[0])["params"]
    assert code == 0
    assert job["TransformInput"]["DataSource"]["S3DataSource"] == {
        "S3DataType": "ManifestFile",
        "S3Uri": IN,
    }
