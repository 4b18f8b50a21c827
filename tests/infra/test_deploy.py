"""`arbiter deploy`: the dry-run plan, the refusals, and the whole path against a moto server."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import botocore.session
import pytest

import infra.deploy as deploy_mod
from arbiter.cli import main as cli_main
from infra.deploy import (
    CPU_INSTANCE_TYPE,
    GPU_INSTANCE_POOL,
    DeployConfig,
    DeployError,
    build_plan,
    parse_image,
)
from infra.deploy_run import deploy
from infra.package_model import package_model
from tests.aws import moto_endpoint, reset_moto
from tests.infra.test_package_model import fake_gguf

DIGEST = "3f" * 32
IMAGE = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/arbiter@sha256:{DIGEST}"


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    fake = fake_gguf(tmp_path / "decider.gguf")
    return package_model(fake, tmp_path / "model.tar.gz", read_check="off").archive


def config(archive: Path, **overrides: Any) -> DeployConfig:
    values: dict[str, Any] = {
        "stack": "arb",
        "bucket": "arb-test-bucket",
        "image": IMAGE,
        "model": str(archive),
        "subnets": ["subnet-12345678"],
        "security_groups": ["sg-12345678"],
        "max_in_flight": 3,
        "poll_s": 1,
        "read_check": "off",  # the fake GGUF cannot load; the check has its own tests (below)
    }
    values.update(overrides)
    return DeployConfig(**values)


def dry_run_lines(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    assert cli_main(["deploy", "--dry-run", "--read-check", "off", *argv]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def serving_params(lines: list[dict[str, Any]]) -> dict[str, str]:
    [change] = [
        s
        for s in lines
        if s["operation"] == "create_stack|update_stack"
        and s["params"]["StackName"] == "arb-serving"
    ]
    return {p["ParameterKey"]: p["ParameterValue"] for p in change["params"]["Parameters"]}


def test_dry_run_prints_every_call(archive: Path, capsys, monkeypatch: pytest.MonkeyPatch):
    # No credentials and an endpoint where nothing listens: a dry run must not need either.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    lines = dry_run_lines(
        [
            "--stack", "arb", "--bucket", "arb-test-bucket", "--image", IMAGE,
            "--model", str(archive), "--subnets", "subnet-12345678,subnet-87654321",
            "--security-groups", "sg-12345678", "--max-in-flight", "3",
            "--endpoint-url", "http://127.0.0.1:9",
        ],
        capsys,
    )  # fmt: skip
    ops = [(s["service"], s["operation"]) for s in lines]
    cfn = "cloudformation"
    assert ops == [
        (cfn, "describe_stacks"),
        (cfn, "create_stack|update_stack"),
        (cfn, "wait:stack_create_complete|stack_update_complete"),
        ("s3", "head_object"),
        ("s3", "put_object"),
        (cfn, "describe_stacks"),
        (cfn, "create_stack|update_stack"),
        (cfn, "wait:stack_create_complete|stack_update_complete"),
        (cfn, "describe_stacks"),
    ]
    assert [s["step"] for s in lines] == list(range(1, 10))
    data = lines[1]["params"]
    assert data["StackName"] == "arb-data"
    assert data["Parameters"] == [
        {"ParameterKey": "BucketName", "ParameterValue": "arb-test-bucket"}
    ]
    assert data["TemplateBody"].startswith("<infra/cloudformation/data.yaml: ")
    assert data["Capabilities"] == ["CAPABILITY_IAM"]
    put = lines[4]["params"]
    assert put["Bucket"] == "arb-test-bucket"
    assert put["Key"].startswith("models/") and put["Key"].endswith("/model.tar.gz")
    assert put["Body"].startswith(f"<{archive}: bytes 0..")

    params = serving_params(lines)
    assert params["ImageUri"] == IMAGE
    assert params["ImageRepositoryArn"] == "arn:aws:ecr:us-east-1:123456789012:repository/arbiter"
    assert params["ModelDataKey"] == put["Key"]
    assert params["CpuInstanceType"] == CPU_INSTANCE_TYPE == "ml.c6i.2xlarge"
    assert params["Accelerator"] == "cpu"
    assert params["EndpointMode"] == "async"
    assert params["MaxInFlight"] == "3"
    assert params["WorkerSubnets"] == "subnet-12345678,subnet-87654321"
    assert params["Workers"] == "true"


def test_gpu_plan_orders_the_instance_pool(archive: Path, capsys):
    lines = dry_run_lines(
        [
            "--stack", "arb", "--bucket", "arb-test-bucket", "--image", IMAGE,
            "--model", str(archive), "--accelerator", "gpu", "--mode", "realtime", "--no-workers",
        ],
        capsys,
    )  # fmt: skip
    params = serving_params(lines)
    assert params["Accelerator"] == "gpu"
    assert params["EndpointMode"] == "realtime"
    assert params["Workers"] == "false"
    assert params["GpuInstanceTypes"].split(",") == [
        "ml.g6e.xlarge",
        "ml.g6.xlarge",
        "ml.g5.xlarge",
        "ml.g4dn.xlarge",
    ]


def test_instance_types_are_real_sagemaker_types():
    """botocore's service model knows every type the deploy uses (moto 5.2.5's list is older)."""
    model = botocore.session.get_session().get_service_model("sagemaker")
    known = set(model.shape_for("ProductionVariantInstanceType").enum)
    assert {CPU_INSTANCE_TYPE, *GPU_INSTANCE_POOL} <= known


@pytest.mark.parametrize(
    "image",
    [
        "arbiter:latest",
        "123456789012.dkr.ecr.us-east-1.amazonaws.com/arbiter:v1",
        "123456789012.dkr.ecr.us-east-1.amazonaws.com/arbiter",
        f"123456789012.dkr.ecr.us-east-1.amazonaws.com/arbiter:v1@sha256:{DIGEST}",
        "123456789012.dkr.ecr.us-east-1.amazonaws.com/arbiter@sha256:abc123",
        f"123456789012.dkr.ecr.us-east-1.amazonaws.com/arbiter@sha256:{DIGEST.upper()}",
        f"docker.io/library/arbiter@sha256:{DIGEST}",
    ],
)
def test_mutable_or_foreign_images_are_refused(image: str, archive: Path, capsys):
    code = cli_main(
        [
            "deploy", "--dry-run", "--read-check", "off", "--stack", "arb",
            "--bucket", "arb-test-bucket",
            "--image", image, "--model", str(archive), "--no-workers",
        ]
    )  # fmt: skip
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing planned, nothing printed
    assert "refused" in captured.err


def test_digest_reference_parses():
    image = parse_image(
        f"123456789012.dkr.ecr.eu-west-1.amazonaws.com/team/arbiter@sha256:{DIGEST}"
    )
    assert image.repository_arn == "arn:aws:ecr:eu-west-1:123456789012:repository/team/arbiter"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"subnets": []}, "--subnets"),
        ({"accelerator": "gpu"}, "CPU-only"),
        ({"mode": "none", "workers": False}, "nothing to deploy"),
        ({"model": "s3://other-bucket/models/m.tar.gz"}, "must be"),
        ({"model": "s3://arb-test-bucket/elsewhere/m.tar.gz"}, "must be"),
        ({"stack": "9lives"}, "stack name"),
    ],
)
def test_refusals(archive: Path, overrides: dict[str, Any], message: str):
    with pytest.raises(DeployError, match=message):
        build_plan(config(archive, **overrides))


def test_model_must_be_a_package(tmp_path: Path):
    plain = tmp_path / "plain.tar.gz"
    plain.write_bytes(b"not a tarball")
    with pytest.raises(DeployError, match="not a readable model archive"):
        build_plan(config(plain))


def test_uploaded_archive_is_referenced_not_uploaded(archive: Path):
    plan = build_plan(config(archive, model="s3://arb-test-bucket/models/abc/model.tar.gz"))
    assert plan.model_key == "models/abc/model.tar.gz"
    assert all(call.service == "cloudformation" for call in plan.calls())


def test_large_archive_plans_a_multipart_upload(archive: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(deploy_mod, "PART_BYTES", 256)
    plan = build_plan(config(archive))
    s3_ops = [c.operation for c in plan.calls() if c.service == "s3"]
    parts = -(-archive.stat().st_size // 256)
    assert parts >= 2
    assert s3_ops == [
        "head_object",
        "create_multipart_upload",
        *["upload_part"] * parts,
        "complete_multipart_upload",
    ]


# ------------------------------------------------------------------------------------ on moto ---


@pytest.fixture
def moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    endpoint = moto_endpoint()
    reset_moto(endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    # moto 5.2.5 validates instance types against a list that predates c6i; the real type is
    # checked against botocore's model in test_instance_types_are_real_sagemaker_types.
    monkeypatch.setattr(deploy_mod, "CPU_INSTANCE_TYPE", "ml.c5.2xlarge")
    yield endpoint
    reset_moto(endpoint)


def clients(endpoint: str) -> dict[str, Any]:
    session = botocore.session.get_session()
    return {
        name: session.create_client(name, region_name="us-east-1", endpoint_url=endpoint)
        for name in ("s3", "sqs", "sagemaker", "ecs", "iam", "sns", "cloudformation")
    }


def run_deploy(cfg: DeployConfig) -> tuple[dict[str, Any], list[str]]:
    out, log = io.StringIO(), []
    assert deploy(cfg, dry_run=False, out=out, log=log.append) == 0
    return json.loads(out.getvalue()), log


def test_deploy_on_moto(moto: str, archive: Path):
    result, log = run_deploy(config(archive, endpoint_url=moto))
    c = clients(moto)
    try:
        outputs = result["outputs"]
        key = result["model_key"]
        # The archive is in the bucket, with its sha256.
        head = c["s3"].head_object(Bucket="arb-test-bucket", Key=key)
        assert head["ContentLength"] == archive.stat().st_size
        assert key == f"models/{head['Metadata']['sha256']}/model.tar.gz"

        # Queue and dead-letter queue, with the redrive policy.
        urls = c["sqs"].list_queues()["QueueUrls"]
        [job_url] = [u for u in urls if "JobQueue" in u]
        [dlq_url] = [u for u in urls if "DeadLetterQueue" in u]
        attrs = c["sqs"].get_queue_attributes(QueueUrl=job_url, AttributeNames=["All"])
        redrive = json.loads(attrs["Attributes"]["RedrivePolicy"])
        dlq_arn = c["sqs"].get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])
        assert redrive == {
            "deadLetterTargetArn": dlq_arn["Attributes"]["QueueArn"],
            "maxReceiveCount": 8,  # the workers' 5 tries + the margin of 3
        }

        # The async endpoint: concurrency equal to the container's bound, S3 paths, SNS topics.
        endpoint = c["sagemaker"].describe_endpoint(EndpointName=outputs["EndpointName"])
        endpoint_config = c["sagemaker"].describe_endpoint_config(
            EndpointConfigName=endpoint["EndpointConfigName"]
        )
        async_config = endpoint_config["AsyncInferenceConfig"]
        assert async_config["ClientConfig"]["MaxConcurrentInvocationsPerInstance"] == 3
        assert async_config["OutputConfig"]["S3OutputPath"] == "s3://arb-test-bucket/async/output/"
        assert (
            async_config["OutputConfig"]["S3FailurePath"] == "s3://arb-test-bucket/async/failures/"
        )
        topics = {t["TopicArn"] for t in c["sns"].list_topics()["Topics"]}
        notify = async_config["OutputConfig"]["NotificationConfig"]
        assert {notify["SuccessTopic"], notify["ErrorTopic"]} <= topics
        [variant] = endpoint_config["ProductionVariants"]
        assert variant["InstanceType"] == "ml.c5.2xlarge"
        model = c["sagemaker"].describe_model(ModelName=outputs["ModelName"])
        assert model["PrimaryContainer"]["Image"] == IMAGE
        assert model["PrimaryContainer"]["ModelDataUrl"] == f"s3://arb-test-bucket/{key}"
        assert model["PrimaryContainer"]["Environment"]["ARBITER_MAX_IN_FLIGHT"] == "3"

        # The worker pool's task: the image, `work`, and where its jobs and model are.
        [task_arn] = c["ecs"].list_task_definitions()["taskDefinitionArns"]
        task = c["ecs"].describe_task_definition(taskDefinition=task_arn)["taskDefinition"]
        [container] = task["containerDefinitions"]
        env = {e["name"]: e["value"] for e in container["environment"]}
        assert container["command"] == ["work"] and container["image"] == IMAGE
        assert env["ARBITER_BUCKET"] == "arb-test-bucket"
        assert env["ARBITER_MODEL_DATA_URL"] == f"s3://arb-test-bucket/{key}"
        assert env["ARBITER_QUEUE_URL"].endswith(job_url.rsplit("/", 1)[-1])
        assert env["ARBITER_DLQ_NAME"] == dlq_url.rsplit("/", 1)[-1]
        roles = {r["RoleName"] for r in c["iam"].list_roles()["Roles"]}
        assert any("WorkerTaskRole" in r for r in roles)
        assert any("SageMakerRole" in r for r in roles)

        # A second run: the archive is not uploaded again, the stacks are updated in place.
        _, log = run_deploy(config(archive, endpoint_url=moto))
        assert any("already holds the archive" in line for line in log)
        assert not any(line.startswith("uploaded") for line in log)
        stacks = c["cloudformation"].describe_stacks()["Stacks"]
        assert sorted(s["StackName"] for s in stacks) == ["arb-data", "arb-serving"]
    finally:
        for client in c.values():
            client.close()


def test_multipart_upload_on_moto(moto: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(deploy_mod, "PART_BYTES", 5 * 1024 * 1024)  # S3's smallest part
    gguf = tmp_path / "big.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(11 * 1024 * 1024))  # incompressible: 3 parts
    archive = package_model(gguf, tmp_path / "model.tar.gz", read_check="off").archive
    result, log = run_deploy(config(archive, endpoint_url=moto, mode="none"))
    assert any("in 3 parts" in line for line in log)
    c = clients(moto)
    try:
        body = c["s3"].get_object(Bucket="arb-test-bucket", Key=result["model_key"])["Body"].read()
        assert body == archive.read_bytes()
    finally:
        for client in c.values():
            client.close()
