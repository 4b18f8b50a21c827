"""The CloudFormation templates: cfn-lint, then the properties moto cannot check (autoscaling,
alarms, IAM scoping, the S3 notification) read from the templates themselves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from arbiter.settings import EngineSettings, EntrypointSettings, ServerSettings
from infra.deploy import CPU_INSTANCE_TYPE, GPU_INSTANCE_POOL
from tests import ROOT
from worker.settings import WorkerSettings

TEMPLATES = ROOT / "infra" / "cloudformation"


def load(name: str) -> dict[str, Any]:
    from cfnlint.decode import decode

    template, problems = decode(str(TEMPLATES / name))
    assert not problems, problems
    assert template is not None
    return template


@pytest.fixture(scope="module")
def data() -> dict[str, Any]:
    return load("data.yaml")


@pytest.fixture(scope="module")
def serving() -> dict[str, Any]:
    return load("serving.yaml")


def props(template: dict[str, Any], name: str) -> dict[str, Any]:
    return template["Resources"][name]["Properties"]


def statements(role: dict[str, Any]) -> dict[str, dict[str, Any]]:
    [policy] = role["Properties"]["Policies"]
    return {s.get("Sid", str(i)): s for i, s in enumerate(policy["PolicyDocument"]["Statement"])}


def actions(statement: dict[str, Any]) -> set[str]:
    found = statement["Action"]
    return {found} if isinstance(found, str) else set(found)


def test_cfn_lint_is_clean():
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "cfn-lint"),
            str(TEMPLATES / "data.yaml"),
            str(TEMPLATES / "serving.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_templates_fit_in_a_create_stack_call():
    for path in TEMPLATES.glob("*.yaml"):
        assert len(path.read_bytes()) < 51_200, f"{path.name}: TemplateBody limit"


def test_abandoned_shards_expire_and_queued_shards_wait_as_long(data: dict[str, Any]):
    rules = {r["Id"]: r for r in props(data, "Bucket")["LifecycleConfiguration"]["Rules"]}
    shards = rules["expire-abandoned-shards"]
    assert shards["Prefix"] == {"Ref": "ShardPrefix"} and shards["Status"] == "Enabled"
    retention_days = props(data, "JobQueue")["MessageRetentionPeriod"] / 86400
    assert shards["ExpirationInDays"] >= retention_days
    assert data["Parameters"]["ShardPrefix"]["Default"] == WorkerSettings().shard_prefix


def test_s3_notification_queue_and_redrive(data: dict[str, Any]):
    bucket = props(data, "Bucket")
    [notification] = bucket["NotificationConfiguration"]["QueueConfigurations"]
    assert notification["Event"] == "s3:ObjectCreated:*"
    assert notification["Queue"] == {"Fn::GetAtt": ["JobQueue", "Arn"]}
    assert notification["Filter"]["S3Key"]["Rules"] == [
        {"Name": "prefix", "Value": {"Ref": "InputPrefix"}}
    ]
    assert data["Resources"]["Bucket"]["DependsOn"] == "JobQueuePolicy"
    [allow] = props(data, "JobQueuePolicy")["PolicyDocument"]["Statement"]
    assert allow["Principal"] == {"Service": "s3.amazonaws.com"}
    assert allow["Action"] == "sqs:SendMessage"
    assert "aws:SourceArn" in allow["Condition"]["ArnEquals"]
    redrive = props(data, "JobQueue")["RedrivePolicy"]
    assert redrive["deadLetterTargetArn"] == {"Fn::GetAtt": ["DeadLetterQueue", "Arn"]}
    assert all(v["PublicAccessBlockConfiguration"] for v in [bucket])


def test_async_concurrency_is_the_container_bound(serving: dict[str, Any]):
    model_env = props(serving, "Model")["PrimaryContainer"]["Environment"]
    client = props(serving, "AsyncEndpointConfig")["AsyncInferenceConfig"]["ClientConfig"]
    assert model_env["ARBITER_MAX_IN_FLIGHT"] == {"Ref": "MaxInFlight"}
    assert client["MaxConcurrentInvocationsPerInstance"] == {"Ref": "MaxInFlight"}
    output = props(serving, "AsyncEndpointConfig")["AsyncInferenceConfig"]["OutputConfig"]
    assert {"S3OutputPath", "S3FailurePath", "NotificationConfig"} <= set(output)
    assert set(output["NotificationConfig"]) == {"SuccessTopic", "ErrorTopic"}


def test_async_scales_on_backlog_down_to_zero_and_back(serving: dict[str, Any]):
    target = props(serving, "EndpointScalableTarget")
    assert target["MinCapacity"] == {"Fn::If": ["IsAsync", 0, {"Ref": "RealtimeMinInstances"}]}
    assert target["ScalableDimension"] == "sagemaker:variant:DesiredInstanceCount"
    tracking = props(serving, "AsyncBacklogScaling")["TargetTrackingScalingPolicyConfiguration"]
    assert (
        tracking["CustomizedMetricSpecification"]["MetricName"]
        == "ApproximateBacklogSizePerInstance"
    )
    alarm = props(serving, "AsyncBacklogWithoutCapacity")
    assert alarm["MetricName"] == "HasBacklogWithoutCapacity"
    assert alarm["AlarmActions"] == [{"Ref": "AsyncScaleFromZero"}]
    assert serving["Resources"]["AsyncScaleFromZero"]["Condition"] == "IsAsync"


def test_gpu_pool_and_cpu_type_match_the_deploy(serving: dict[str, Any]):
    params = serving["Parameters"]
    assert params["CpuInstanceType"]["Default"] == CPU_INSTANCE_TYPE
    assert params["GpuInstanceTypes"]["Default"].split(",") == list(GPU_INSTANCE_POOL)
    for config in ("RealtimeEndpointConfig", "AsyncEndpointConfig"):
        [variant] = props(serving, config)["ProductionVariants"]
        condition, pools, _none = variant["InstancePools"]["Fn::If"]
        assert condition == "IsGpu"
        assert [p["Priority"] for p in pools] == [1, 2, 3, 4]
        assert [p["InstanceType"]["Fn::Select"][0] for p in pools] == [0, 1, 2, 3]
        assert variant["InstanceType"]["Fn::If"][0] == "IsGpu"


def test_image_pattern_refuses_tags(serving: dict[str, Any]):
    pattern = re.compile(serving["Parameters"]["ImageUri"]["AllowedPattern"])
    repo = "123456789012.dkr.ecr.us-east-1.amazonaws.com/arbiter"
    assert pattern.match(f"{repo}@sha256:{'a' * 64}")
    assert not pattern.match(f"{repo}:latest")
    assert not pattern.match(f"{repo}@sha256:{'a' * 63}")


def test_worker_role_is_least_privilege(serving: dict[str, Any]):
    """Read the input prefix and the model, write the output prefix, keep shards under the shard
    prefix, use the queue, protect its own task from scale-in: nothing else."""
    granted = statements(serving["Resources"]["WorkerTaskRole"])
    assert {sid: actions(s) for sid, s in granted.items()} == {
        "ReadJobsAndModel": {"s3:GetObject"},
        "WriteResults": {"s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"},
        "WorkShards": {
            "s3:GetObject",
            "s3:PutObject",
            "s3:DeleteObject",
            "s3:AbortMultipartUpload",
        },
        "ListJobsResultsAndShardsOnly": {"s3:ListBucket"},
        "FindLeftoverUploads": {"s3:ListBucketMultipartUploads"},
        "ConsumeJobs": {
            "sqs:SendMessage",
            "sqs:ReceiveMessage",
            "sqs:DeleteMessage",
            "sqs:ChangeMessageVisibility",
            "sqs:GetQueueAttributes",
            "sqs:GetQueueUrl",
        },
        "PoisonToDeadLetter": {"sqs:SendMessage", "sqs:GetQueueUrl"},
        "OwnScaleInProtection": {"ecs:UpdateTaskProtection", "ecs:GetTaskProtection"},
    }
    for statement in granted.values():
        assert statement["Effect"] == "Allow"
        assert statement["Resource"] != "*"
    read = [r["Fn::Sub"][0] for r in granted["ReadJobsAndModel"]["Resource"]]
    assert read == [
        "arn:${AWS::Partition}:s3:::${Bucket}/${Prefix}*",
        "arn:${AWS::Partition}:s3:::${Bucket}/${ModelDataKey}",
    ]
    input_prefix = granted["ReadJobsAndModel"]["Resource"][0]["Fn::Sub"][1]["Prefix"]
    assert input_prefix == {"Fn::ImportValue": {"Fn::Sub": "${DataStack}-InputPrefix"}}
    output_prefix = granted["WriteResults"]["Resource"]["Fn::Sub"][1]["Prefix"]
    assert output_prefix == {"Fn::ImportValue": {"Fn::Sub": "${DataStack}-OutputPrefix"}}
    shard_prefix = granted["WorkShards"]["Resource"]["Fn::Sub"][1]["Prefix"]
    assert shard_prefix == {"Fn::ImportValue": {"Fn::Sub": "${DataStack}-ShardPrefix"}}
    listed = granted["ListJobsResultsAndShardsOnly"]["Condition"]["StringLike"]["s3:prefix"]
    assert [p["Fn::Sub"][1]["Prefix"] for p in listed] == [
        input_prefix,
        output_prefix,
        shard_prefix,
    ]


def test_no_wildcard_grants_beyond_the_unscopable(serving: dict[str, Any]):
    """`Resource: "*"` only for the two actions AWS does not scope (ECR token, metric data)."""
    for name, resource in serving["Resources"].items():
        if resource["Type"] != "AWS::IAM::Role":
            continue
        for statement in statements(resource).values():
            assert not any(a.endswith(":*") or a == "*" for a in actions(statement)), name
            if statement["Resource"] == "*":
                assert actions(statement) <= {
                    "ecr:GetAuthorizationToken",
                    "cloudwatch:PutMetricData",
                }


def test_worker_pool_scales_on_queue_depth_to_zero(serving: dict[str, Any]):
    target = props(serving, "WorkerScalableTarget")
    assert target["MinCapacity"] == 0 and target["ScalableDimension"] == "ecs:service:DesiredCount"
    assert props(serving, "WorkerService")["DesiredCount"] == 0
    waiting = props(serving, "WorkerJobsWaiting")
    assert waiting["MetricName"] == "ApproximateNumberOfMessagesVisible"
    assert waiting["AlarmActions"] == [{"Ref": "WorkerScaleOut"}]
    idle = props(serving, "WorkerQueueIdle")
    names = {m["MetricStat"]["Metric"]["MetricName"] for m in idle["Metrics"] if "MetricStat" in m}
    # In-flight jobs count too: a task holding a job is never scaled away; and so do messages given
    # back with a delay through an outage (issue 36: they looked like an empty queue).
    assert names == {
        "ApproximateNumberOfMessagesVisible",
        "ApproximateNumberOfMessagesNotVisible",
        "ApproximateNumberOfMessagesDelayed",
    }
    [total] = [m["Expression"] for m in idle["Metrics"] if "Expression" in m]
    assert total == "visible + inflight + delayed"
    out = props(serving, "WorkerScaleOut")["StepScalingPolicyConfiguration"]["StepAdjustments"]
    # A large job's shards (hundreds of messages) add tasks ten at a time.
    assert [s["ScalingAdjustment"] for s in out] == [1, 4, 10]
    [step] = props(serving, "WorkerScaleToZero")["StepScalingPolicyConfiguration"][
        "StepAdjustments"
    ]
    assert step["ScalingAdjustment"] == 0
    assert (
        props(serving, "WorkerScaleToZero")["StepScalingPolicyConfiguration"]["AdjustmentType"]
        == "ExactCapacity"
    )


def test_worker_pool_scales_in_by_idle_tasks_which_alone_are_unprotected(serving: dict[str, Any]):
    """Through a job's tail the idle tasks go (not only all of them, 10 minutes after the end), and
    the tasks ECS may stop are the idle ones: each protects itself while it holds a message."""
    idle = props(serving, "WorkerTasksIdle")
    assert idle["AlarmActions"] == [{"Ref": "WorkerScaleIn"}]
    [expression] = [m["Expression"] for m in idle["Metrics"] if "Expression" in m]
    assert expression == "IF(visible == 0 AND delayed == 0 AND inflight > 0, tasks - inflight, 0)"
    stats = {m["Id"]: m["MetricStat"] for m in idle["Metrics"] if "MetricStat" in m}
    assert stats["tasks"]["Metric"]["MetricName"] == "RunningTaskCount"
    assert stats["tasks"]["Metric"]["Namespace"] == "ECS/ContainerInsights"
    cluster = props(serving, "WorkerCluster")["ClusterSettings"]
    assert {"Name": "containerInsights", "Value": "enabled"} in cluster  # RunningTaskCount's source
    steps = props(serving, "WorkerScaleIn")["StepScalingPolicyConfiguration"]["StepAdjustments"]
    assert [s["ScalingAdjustment"] for s in steps] == [-1, -4, -10]
    grant = statements(serving["Resources"]["WorkerTaskRole"])["OwnScaleInProtection"]
    assert actions(grant) == {"ecs:UpdateTaskProtection", "ecs:GetTaskProtection"}
    assert "task/${WorkerCluster}/*" in grant["Resource"]["Fn::Sub"]
    # The pool protects the task by default wherever ECS runs it (ECS_AGENT_URI is set there).
    assert WorkerSettings(ECS_AGENT_URI="http://169.254.170.2/api/x").task_protection


def test_container_environment_names_real_settings(serving: dict[str, Any]):
    """Every ARBITER_* the stack sets is a field the image reads (catches renamed settings)."""
    known = set()
    for settings in (WorkerSettings, EngineSettings, ServerSettings, EntrypointSettings):
        known |= {f"ARBITER_{name.upper()}" for name in settings.model_fields}
    [container] = props(serving, "WorkerTaskDefinition")["ContainerDefinitions"]
    names = {e["Name"] for e in container["Environment"]}
    names |= set(props(serving, "Model")["PrimaryContainer"]["Environment"])
    assert names <= known, names - known
    assert container["Command"] == ["work"]
    assert container["StopTimeout"] == 120


def test_a_versioned_bucket_sheds_the_workers_old_versions_and_markers(data: dict[str, Any]):
    """On a versioned bucket the clean-up's deletes only add markers and every status count a
    version (a 40-line job left 31 noncurrent shard versions, 31 markers and 12 status versions,
    for ever): the shard prefix's noncurrent versions and then its markers expire, and under the
    output prefix only objects with more than a few noncurrent versions (a status) lose the older
    ones; inputs are the user's and have no rule."""
    rules = {r["Id"]: r for r in props(data, "Bucket")["LifecycleConfiguration"]["Rules"]}
    shards = rules["expire-noncurrent-shard-versions"]
    assert shards["Prefix"] == {"Ref": "ShardPrefix"} and shards["Status"] == "Enabled"
    assert shards["NoncurrentVersionExpiration"]["NoncurrentDays"] <= 7
    markers = rules["expire-shard-delete-markers"]
    assert markers["Prefix"] == {"Ref": "ShardPrefix"} and markers["ExpiredObjectDeleteMarker"]
    status = rules["expire-noncurrent-status-versions"]
    assert status["Prefix"] == {"Ref": "OutputPrefix"} and status["Status"] == "Enabled"
    assert status["NoncurrentVersionExpiration"]["NewerNoncurrentVersions"] >= 1
    assert not any(r.get("Prefix") == {"Ref": "InputPrefix"} for r in rules.values())


def test_the_worker_reads_current_versions_only(serving: dict[str, Any]):
    """The worker reads a job's current version with If-Match on the event's ETag, never by
    VersionId (worker/jobs.py, locate): its role needs no s3:GetObjectVersion, on a versioned
    bucket or not (tests/worker/test_versioned.py runs jobs under a proxy that denies it)."""
    granted = set().union(
        *(actions(s) for s in statements(serving["Resources"]["WorkerTaskRole"]).values())
    )
    assert "s3:GetObject" in granted and "s3:GetObjectVersion" not in granted
