"""`arbiter deploy`: the two CloudFormation stacks and the model archive, in order.

1. the data stack (``infra/cloudformation/data.yaml``): bucket, S3 -> SQS notification, job queue and
   dead-letter queue, async inference SNS topics;
2. the model archive (``arbiter package-model``) uploaded to ``models/<archive sha256>/model.tar.gz``
   in that bucket (skipped when that key already holds it);
3. the serving stack (``infra/cloudformation/serving.yaml``): the SageMaker model, endpoint config and
   endpoint (real-time or async) and the ECS Fargate worker pool, each autoscaled.

Every AWS call is a :class:`Call` in a plan built before anything runs; ``--dry-run`` prints the plan
(one JSON object per call) and makes no call at all, so it needs no credentials; running a plan is
:mod:`infra.deploy_run`'s. Only an image pinned
by digest (``repo@sha256:<64 hex>``) is accepted: a tag can be moved after the review of a plan.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

# The CPU endpoint's instance type is fixed: 8 vCPU Ice Lake (AVX-512 VNNI, no AMX), 16 GiB.
CPU_INSTANCE_TYPE = "ml.c6i.2xlarge"
# GPU: SageMaker provisions from the first pool with capacity, in this order (InstancePools).
GPU_INSTANCE_POOL = ("ml.g6e.xlarge", "ml.g6.xlarge", "ml.g5.xlarge", "ml.g4dn.xlarge")
MODEL_PREFIX = "models/"
PART_BYTES = 64 * 1024 * 1024  # multipart upload part size for large archives
_IMAGE = re.compile(
    r"^(?P<registry>[a-z0-9.-]+(?::[0-9]+)?)/(?P<repo>[a-z0-9]+(?:[._/-][a-z0-9]+)*)"
    r"@sha256:(?P<digest>[0-9a-f]{64})$"
)
_ECR = re.compile(
    r"^(?P<account>[0-9]{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?P<cn>\.cn)?$"
)
_STACK = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,100}$")


class DeployError(Exception):
    """The deployment was refused before any call (bad image reference, missing option, ...)."""


@dataclass(frozen=True)
class Image:
    uri: str
    repository_arn: str


def parse_image(uri: str) -> Image:
    """Accept only ``<account>.dkr.ecr.<region>.amazonaws.com/<repo>@sha256:<64 hex>``."""
    match = _IMAGE.match(uri.strip())
    if match is None:
        if "@sha256:" not in uri:
            raise DeployError(
                f"image {uri!r} is not pinned by digest; mutable tags are refused. Push the image "
                "and pass REPO@sha256:<digest> (`docker buildx imagetools inspect` or "
                "`aws ecr describe-images` prints it)"
            )
        raise DeployError(
            f"image {uri!r} is not REPO@sha256:<64 lower-case hex> (a tag together with the "
            "digest is refused too: the digest alone names the image)"
        )
    ecr = _ECR.match(match["registry"])
    if ecr is None:
        raise DeployError(
            f"image registry {match['registry']!r} is not Amazon ECR; SageMaker and the roles this "
            "stack creates pull from ECR (<account>.dkr.ecr.<region>.amazonaws.com)"
        )
    partition = "aws-cn" if ecr["cn"] else "aws"
    arn = f"arn:{partition}:ecr:{ecr['region']}:{ecr['account']}:repository/{match['repo']}"
    return Image(uri=uri.strip(), repository_arn=arn)


@dataclass
class DeployConfig:
    stack: str
    bucket: str
    image: str
    model: str  # a local model.tar.gz, or s3://<bucket>/models/...tar.gz already uploaded
    region: str = "us-east-1"
    mode: str = "async"  # realtime | async | none
    accelerator: str = "cpu"  # cpu | gpu
    max_in_flight: int = 1
    endpoint_max_instances: int = 2
    workers: bool = True
    subnets: list[str] = field(default_factory=list)
    security_groups: list[str] = field(default_factory=list)
    assign_public_ip: bool = False
    worker_max_tasks: int = 4
    worker_processes: int = 1
    endpoint_url: str | None = None  # moto / LocalStack
    poll_s: int = 15
    read_check: str = "refuse"  # on a local archive: refuse | warn | off (infra.package_check)


@dataclass(frozen=True)
class Call:
    """One AWS API call: ``client(service).<operation>(**params)``."""

    service: str
    operation: str
    params: dict[str, Any]
    note: str = ""

    def describe(self) -> dict[str, Any]:
        shown = {k: _shown(v) for k, v in self.params.items()}
        out: dict[str, Any] = {
            "service": self.service,
            "operation": self.operation,
            "params": shown,
        }
        if self.note:
            out["note"] = self.note
        return out


@dataclass(frozen=True)
class FileBody:
    """An upload's body, read only when the call runs."""

    path: Path
    offset: int = 0
    length: int | None = None

    def read(self) -> bytes:
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            return handle.read(-1 if self.length is None else self.length)


@dataclass(frozen=True)
class Template:
    name: str
    body: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.body.encode()).hexdigest()


def _shown(value: Any) -> Any:
    if isinstance(value, Template):
        return (
            f"<infra/cloudformation/{value.name}: {len(value.body)} bytes, sha256 {value.sha256}>"
        )
    if isinstance(value, FileBody):
        length = value.length if value.length is not None else value.path.stat().st_size
        return f"<{value.path}: bytes {value.offset}..{value.offset + length}>"
    return value


def load_template(name: str) -> Template:
    text = resources.files("infra").joinpath("cloudformation", name).read_text()
    return Template(name, text)


def data_stack_name(stack: str) -> str:
    return f"{stack}-data"


def serving_stack_name(stack: str) -> str:
    return f"{stack}-serving"


def _params(values: dict[str, str]) -> list[dict[str, str]]:
    return [{"ParameterKey": k, "ParameterValue": v} for k, v in values.items()]


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(8 * 1024 * 1024):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Plan:
    config: DeployConfig
    image: Image
    model_key: str
    model_file: Path | None
    model_sha256: str | None
    steps: list[Call]

    def calls(self) -> Iterator[Call]:
        yield from self.steps


def validate(config: DeployConfig) -> Image:
    if not _STACK.match(config.stack) or len(config.stack) > 100:
        raise DeployError(
            f"stack name {config.stack!r}: letters, digits and hyphens, first a letter"
        )
    if config.mode not in {"realtime", "async", "none"}:
        raise DeployError("--mode is realtime, async or none")
    if config.accelerator not in {"cpu", "gpu"}:
        raise DeployError("--accelerator is cpu or gpu")
    if config.mode == "none" and not config.workers:
        raise DeployError("nothing to deploy: --mode none and --no-workers")
    if config.workers and (not config.subnets or not config.security_groups):
        raise DeployError(
            "the worker pool needs --subnets and --security-groups (Fargate tasks run in your VPC)"
        )
    if config.accelerator == "gpu" and config.workers:
        raise DeployError(
            "the Fargate worker pool is CPU-only; deploy workers with --accelerator cpu (and the "
            "CPU image), or pass --no-workers for a GPU endpoint"
        )
    if config.max_in_flight < 1:
        raise DeployError("--max-in-flight must be at least 1")
    return parse_image(config.image)


def _model_location(config: DeployConfig) -> tuple[str, Path | None, str | None]:
    """(key in the data bucket, local archive or None, archive sha256 or None)."""
    if config.model.startswith("s3://"):
        bucket, _, key = config.model[5:].partition("/")
        if (
            bucket != config.bucket
            or not key.startswith(MODEL_PREFIX)
            or not key.endswith(".tar.gz")
        ):
            raise DeployError(
                f"--model {config.model}: an uploaded archive must be "
                f"s3://{config.bucket}/{MODEL_PREFIX}...tar.gz (the roles read only that prefix)"
            )
        return key, None, None
    from infra.package_model import PackageError, read_archive_manifest

    path = Path(config.model)
    if not path.is_file():
        raise DeployError(f"--model {path} does not exist")
    try:
        read_archive_manifest(path)
    except PackageError as exc:
        raise DeployError(str(exc)) from exc
    sha = _sha256_file(path)
    return f"{MODEL_PREFIX}{sha}/model.tar.gz", path, sha


def _stack_calls(
    name: str, template: Template, params: dict[str, str], config: DeployConfig
) -> list[Call]:
    tags = [{"Key": "arbiter:stack", "Value": config.stack}]
    waiter = {"Delay": config.poll_s, "MaxAttempts": max(1, 3600 // max(config.poll_s, 1))}
    return [
        Call(
            "cloudformation",
            "describe_stacks",
            {"StackName": name},
            "exists? then update, else create",
        ),
        Call(
            "cloudformation",
            "create_stack|update_stack",
            {
                "StackName": name,
                "TemplateBody": template,
                "Parameters": _params(params),
                "Capabilities": ["CAPABILITY_IAM"],
                "Tags": tags,
            },
            "create_stack adds OnFailure=DELETE; 'No updates are to be performed' is success",
        ),
        Call(
            "cloudformation",
            "wait:stack_create_complete|stack_update_complete",
            {"StackName": name, "WaiterConfig": waiter},
        ),
    ]


def _upload_calls(bucket: str, key: str, path: Path, sha: str) -> list[Call]:
    size = path.stat().st_size
    meta = {"Bucket": bucket, "Key": key}
    head = Call("s3", "head_object", dict(meta), "skip the upload when the key holds this archive")
    extra = {"Metadata": {"sha256": sha}, "ContentType": "application/gzip"}
    if size <= PART_BYTES:
        return [head, Call("s3", "put_object", {**meta, **extra, "Body": FileBody(path)})]
    parts = [
        Call(
            "s3",
            "upload_part",
            {
                **meta,
                "UploadId": "<from create_multipart_upload>",
                "PartNumber": n + 1,
                "Body": FileBody(path, offset, min(PART_BYTES, size - offset)),
            },
        )
        for n, offset in enumerate(range(0, size, PART_BYTES))
    ]
    return [
        head,
        Call("s3", "create_multipart_upload", {**meta, **extra}),
        *parts,
        Call(
            "s3",
            "complete_multipart_upload",
            {
                **meta,
                "UploadId": "<from create_multipart_upload>",
                "MultipartUpload": "<part ETags>",
            },
        ),
    ]


def build_plan(config: DeployConfig) -> Plan:
    """Every call, in order, with its parameters; nothing is called."""
    image = validate(config)
    model_key, model_file, model_sha = _model_location(config)
    data = data_stack_name(config.stack)
    data_params = {"BucketName": config.bucket}
    serving_params = {
        "DataStack": data,
        "ImageUri": image.uri,
        "ImageRepositoryArn": image.repository_arn,
        "ModelDataKey": model_key,
        "EndpointMode": config.mode,
        "Accelerator": config.accelerator,
        "CpuInstanceType": CPU_INSTANCE_TYPE,
        "GpuInstanceTypes": ",".join(GPU_INSTANCE_POOL),
        "MaxInFlight": str(config.max_in_flight),
        "EndpointMaxInstances": str(config.endpoint_max_instances),
        "Workers": "true" if config.workers else "false",
        "WorkerSubnets": ",".join(config.subnets),
        "WorkerSecurityGroups": ",".join(config.security_groups),
        "WorkerAssignPublicIp": "ENABLED" if config.assign_public_ip else "DISABLED",
        "WorkerMaxTasks": str(config.worker_max_tasks),
        "WorkerProcesses": str(config.worker_processes),
    }
    steps = _stack_calls(data, load_template("data.yaml"), data_params, config)
    if model_file is not None and model_sha is not None:
        steps += _upload_calls(config.bucket, model_key, model_file, model_sha)
    steps += _stack_calls(
        serving_stack_name(config.stack), load_template("serving.yaml"), serving_params, config
    )
    steps.append(
        Call("cloudformation", "describe_stacks", {"StackName": serving_stack_name(config.stack)})
    )
    return Plan(config, image, model_key, model_file, model_sha, steps)


def print_plan(plan: Plan, out: TextIO) -> None:
    for number, call in enumerate(plan.calls(), start=1):
        out.write(json.dumps({"step": number, **call.describe()}) + "\n")
