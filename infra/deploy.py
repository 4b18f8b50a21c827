"""`arbiter deploy`: the two CloudFormation stacks and the model archive, in order.

1. the data stack (``infra/cloudformation/data.yaml``): bucket, S3 -> SQS notification, job queue and
   dead-letter queue, async inference SNS topics;
2. the model archive (``arbiter package-model``) uploaded to ``models/<archive sha256>/model.tar.gz``
   in that bucket (skipped when that key already holds it);
3. the serving stack (``infra/cloudformation/serving.yaml``): the SageMaker model, endpoint config and
   endpoint (real-time or async) and the ECS Fargate worker pool, each autoscaled.

Every AWS call is a :class:`Call` in a plan built before anything runs; ``--dry-run`` prints the plan
(one JSON object per call) and makes no call at all, so it needs no credentials. Only an image pinned
by digest (``repo@sha256:<64 hex>``) is accepted: a tag can be moved after the review of a plan.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

from botocore.exceptions import ClientError

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


# ----------------------------------------------------------------------------------- execution ---


class Runner:
    """Runs a plan's calls with botocore clients (one per service)."""

    def __init__(self, config: DeployConfig, log: Callable[[str], None]) -> None:
        import botocore.session

        self.config = config
        self.session = botocore.session.get_session()
        self.clients: dict[str, Any] = {}
        self.log = log

    def client(self, service: str) -> Any:
        if service not in self.clients:
            self.clients[service] = self.session.create_client(
                service, region_name=self.config.region, endpoint_url=self.config.endpoint_url
            )
        return self.clients[service]

    def close(self) -> None:
        for client in self.clients.values():
            client.close()

    def run(self, plan: Plan) -> dict[str, str]:
        steps = list(plan.calls())
        outputs: dict[str, str] = {}
        i = 0
        while i < len(steps):
            call = steps[i]
            if call.operation == "describe_stacks" and i + 1 < len(steps):
                exists = self._stack_exists(call.params["StackName"])
                self._deploy_stack(steps[i + 1], steps[i + 2], exists)
                i += 3
            elif call.operation == "head_object":
                uploads = [s for s in steps[i + 1 :] if s.service == "s3"]
                if not self._already_uploaded(call, plan.model_sha256):
                    self._upload(uploads)
                i += 1 + len(uploads)
            elif call.operation == "describe_stacks":
                stack = self.client("cloudformation").describe_stacks(**call.params)["Stacks"][0]
                outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
                i += 1
            else:  # pragma: no cover - every planned call is handled above
                raise DeployError(f"unplanned call {call.operation}")
        return outputs

    def _stack_exists(self, name: str) -> bool:
        try:
            stacks = self.client("cloudformation").describe_stacks(StackName=name)["Stacks"]
        except ClientError as exc:
            if "does not exist" in str(exc):
                return False
            raise
        return bool(stacks) and stacks[0]["StackStatus"] != "DELETE_COMPLETE"

    def _deploy_stack(self, change: Call, wait: Call, exists: bool) -> None:
        cfn = self.client("cloudformation")
        params = {k: (v.body if isinstance(v, Template) else v) for k, v in change.params.items()}
        name = params["StackName"]
        if exists:
            self.log(f"updating stack {name}")
            try:
                cfn.update_stack(**params)
            except ClientError as exc:
                if "No updates are to be performed" in str(exc):
                    self.log(f"stack {name}: no changes")
                    return
                raise
            waiter = "stack_update_complete"
        else:
            self.log(f"creating stack {name}")
            cfn.create_stack(**params, OnFailure="DELETE")
            waiter = "stack_create_complete"
        cfn.get_waiter(waiter).wait(**wait.params)
        self.log(f"stack {name}: done")

    def _already_uploaded(self, head: Call, sha: str | None) -> bool:
        try:
            found = self.client("s3").head_object(**head.params)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in {"404", "NoSuchKey", "NotFound"}:
                return False
            raise
        same = bool(found.get("Metadata", {}).get("sha256") == sha)
        if same:
            self.log(f"s3://{head.params['Bucket']}/{head.params['Key']} already holds the archive")
        return same

    def _upload(self, calls: list[Call]) -> None:
        s3 = self.client("s3")
        if calls[0].operation == "put_object":
            params = dict(calls[0].params)
            params["Body"] = params["Body"].read()
            s3.put_object(**params)
            self.log(f"uploaded s3://{params['Bucket']}/{params['Key']}")
            return
        create, *parts, complete = calls
        upload_id = s3.create_multipart_upload(**create.params)["UploadId"]
        try:
            done = []
            for part in parts:
                params = {**part.params, "UploadId": upload_id, "Body": part.params["Body"].read()}
                etag = s3.upload_part(**params)["ETag"]
                done.append({"ETag": etag, "PartNumber": params["PartNumber"]})
            s3.complete_multipart_upload(
                Bucket=complete.params["Bucket"],
                Key=complete.params["Key"],
                UploadId=upload_id,
                MultipartUpload={"Parts": done},
            )
        except BaseException:
            s3.abort_multipart_upload(
                Bucket=create.params["Bucket"], Key=create.params["Key"], UploadId=upload_id
            )
            raise
        self.log(
            f"uploaded s3://{create.params['Bucket']}/{create.params['Key']} in {len(parts)} parts"
        )


def deploy(config: DeployConfig, *, dry_run: bool, out: TextIO, log: Callable[[str], None]) -> int:
    plan = build_plan(config)
    if dry_run:
        print_plan(plan, out)
        return 0
    runner = Runner(config, log)
    try:
        outputs = runner.run(plan)
    finally:
        runner.close()
    out.write(
        json.dumps({"stack": config.stack, "model_key": plan.model_key, "outputs": outputs}) + "\n"
    )
    return 0
