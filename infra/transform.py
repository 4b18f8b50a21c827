"""A Batch Transform job, defined once: the parameters `arbiter transform` runs locally
(``emulator.transform``) and sends to AWS as ``CreateTransformJob`` (``--aws``).

On AWS a transform job needs a SageMaker model: either one that exists (``--model-name``, for example
the serving stack's ``ModelName`` output), or one created here from the image, pinned by digest as
``arbiter deploy`` requires, and the model archive. Like the deploy, the calls form a plan that
``--dry-run`` prints (one JSON object per call) without credentials.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from infra.deploy import CPU_INSTANCE_TYPE, Call, DeployError, parse_image
from infra.patterns import compiled

_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
_S3 = re.compile(r"^s3://[^/]+(/.*)?$")
SPLIT_TYPES = ("None", "Line")
STRATEGIES = ("MultiRecord", "SingleRecord")
ASSEMBLE = ("None", "Line")
COMPRESSION = ("None", "Gzip")
DATA_TYPES = ("S3Prefix", "ManifestFile")  # TransformS3DataSource's compatible S3DataTypes


class TransformError(DeployError):
    """The job was refused before anything ran."""


@dataclass(frozen=True)
class TransformJob:
    """``CreateTransformJob``'s parameters; None means "the container's, else SageMaker's default"
    (``GET /execution-parameters`` first, then 1 transform, 6 MB, SingleRecord)."""

    input_uri: str  # S3Prefix: every object under it is an input; ManifestFile: the manifest
    output_uri: str
    name: str = ""
    data_type: str = "S3Prefix"
    content_type: str = "application/jsonlines"
    accept: str = "application/jsonlines"
    split_type: str = "Line"
    compression: str = "None"
    batch_strategy: str | None = None
    max_payload_mb: int | None = None
    max_concurrent_transforms: int | None = None
    assemble_with: str = "Line"
    input_filter: str | None = None  # DataProcessing: None sends nothing ("$" on AWS)
    output_filter: str | None = None
    join_source: str | None = None  # "Input" or "None"
    invocations_timeout_s: int = 600
    invocations_max_retries: int = 3
    instance_type: str = CPU_INSTANCE_TYPE
    instance_count: int = 1
    environment: dict[str, str] = field(default_factory=dict)

    def job_name(self) -> str:
        return self.name or time.strftime("arbiter-transform-%Y%m%d-%H%M%S", time.gmtime())

    def validate(self) -> None:
        """SageMaker's rules for these parameters, checked before any call."""
        problems = []
        for label, uri in (("input", self.input_uri), ("output", self.output_uri)):
            if not _S3.match(uri):
                problems.append(f"the {label} must be an s3:// URI (got {uri!r})")
        if self.name and not _NAME.match(self.name):
            problems.append("the job name is 1-63 letters, digits and hyphens")
        choices = (
            ("SplitType", self.split_type, SPLIT_TYPES),
            ("AssembleWith", self.assemble_with, ASSEMBLE),
            ("CompressionType", self.compression, COMPRESSION),
            ("BatchStrategy", self.batch_strategy or "SingleRecord", STRATEGIES),
        )
        problems += [f"{n} is one of {', '.join(c)}" for n, v, c in choices if v not in c]
        problems += self._input_problems()
        if self.max_payload_mb is not None and not 0 <= self.max_payload_mb <= 100:
            problems.append("MaxPayloadInMB is 0 to 100")
        if self.max_concurrent_transforms is not None and self.max_concurrent_transforms < 0:
            problems.append("MaxConcurrentTransforms is at least 0 (0: the container's)")
        if (self.max_payload_mb or 0) * (self.max_concurrent_transforms or 1) > 100:
            problems.append("MaxConcurrentTransforms x MaxPayloadInMB is at most 100")
        if not 1 <= self.invocations_timeout_s <= 3600:
            problems.append("InvocationsTimeoutInSeconds is 1 to 3600")
        if not 0 <= self.invocations_max_retries <= 3:
            problems.append("InvocationsMaxRetries is 0 to 3")
        if len(self.all_environment()) > 16:
            problems.append("a transform job's Environment holds at most 16 entries")
        if problems:
            raise TransformError("; ".join(problems))

    def _input_problems(self) -> list[str]:
        """S3DataType and DataProcessing."""
        problems = []
        if self.data_type not in DATA_TYPES:
            problems.append(
                f"S3DataType {self.data_type!r} is not compatible with batch transform (SageMaker's "
                f"TransformS3DataSource: the compatible values are {' and '.join(DATA_TYPES)})"
            )
        if self.join_source not in (None, "Input", "None"):
            problems.append("JoinSource is Input or None")
        for label, path in (
            ("InputFilter", self.input_filter),
            ("OutputFilter", self.output_filter),
        ):
            if path is not None and len(path) > 63:
                problems.append(f"{label} is a JSONPath of at most 63 characters")
        return problems

    def all_environment(self) -> dict[str, str]:
        # The container sizes its advertised MaxPayloadInMB to the job's invocation timeout.
        return {
            "ARBITER_BATCH_INVOCATION_TIMEOUT_S": str(self.invocations_timeout_s),
            **self.environment,
        }

    def request(self, model_name: str) -> dict[str, Any]:
        """The ``CreateTransformJob`` request."""
        params: dict[str, Any] = {
            "TransformJobName": self.job_name(),
            "ModelName": model_name,
            "ModelClientConfig": {
                "InvocationsTimeoutInSeconds": self.invocations_timeout_s,
                "InvocationsMaxRetries": self.invocations_max_retries,
            },
            "Environment": self.all_environment(),
            "TransformInput": {
                "DataSource": {
                    "S3DataSource": {"S3DataType": self.data_type, "S3Uri": self.input_uri}
                },
                "ContentType": self.content_type,
                "CompressionType": self.compression,
                "SplitType": self.split_type,
            },
            "TransformOutput": {
                "S3OutputPath": self.output_uri,
                "Accept": self.accept,
                "AssembleWith": self.assemble_with,
            },
            "TransformResources": {
                "InstanceType": self.instance_type,
                "InstanceCount": self.instance_count,
            },
        }
        processing = {
            "InputFilter": self.input_filter,
            "OutputFilter": self.output_filter,
            "JoinSource": self.join_source,
        }
        if any(v is not None for v in processing.values()):
            params["DataProcessing"] = {k: v for k, v in processing.items() if v is not None}
        if self.batch_strategy is not None:
            params["BatchStrategy"] = self.batch_strategy
        if self.max_payload_mb is not None:
            params["MaxPayloadInMB"] = self.max_payload_mb
        if self.max_concurrent_transforms is not None:
            params["MaxConcurrentTransforms"] = self.max_concurrent_transforms
        return params


@dataclass(frozen=True)
class TransformModel:
    """A SageMaker model made for the job: the image by digest, the archive, the role."""

    image: str
    model_data: str
    role_arn: str
    environment: dict[str, str] = field(default_factory=lambda: {"ARBITER_LOG_JSON": "true"})

    def request(self) -> dict[str, Any]:
        image = parse_image(self.image)
        if not (self.model_data.startswith("s3://") and self.model_data.endswith(".tar.gz")):
            raise TransformError(
                f"--model-data {self.model_data!r}: an s3:// model.tar.gz (`arbiter package-model`)"
            )
        container = {
            "Image": image.uri,
            "ModelDataUrl": self.model_data,
            "Environment": self.environment,
        }
        # Named by what it is: the same image, archive and environment give the same model.
        digest = hashlib.sha256(json.dumps(container, sort_keys=True).encode()).hexdigest()[:16]
        return {
            "ModelName": f"arbiter-transform-{digest}",
            "PrimaryContainer": container,
            "ExecutionRoleArn": self.role_arn,
        }


def check_against_model(operation: str, params: dict[str, Any]) -> None:
    """``params`` against botocore's own sagemaker model: what botocore validates (types, required
    members, minima), and what it sends unchecked but AWS refuses (enums, maxima, patterns)."""
    import botocore.session
    from botocore.validate import ParamValidator

    model = botocore.session.get_session().get_service_model("sagemaker")
    shape = model.operation_model(_OPERATIONS[operation]).input_shape
    problems: list[str] = []
    report = ParamValidator().validate(params, shape)
    if report.has_errors():
        problems.append(report.generate_report().replace("\n", "; "))
    _walk(shape, params, operation, problems)
    if problems:
        raise TransformError("; ".join(problems))


_OPERATIONS = {"create_model": "CreateModel", "create_transform_job": "CreateTransformJob"}


def _walk(shape: Any, value: Any, where: str, problems: list[str]) -> None:
    if shape.type_name == "structure" and isinstance(value, dict):
        for name, item in value.items():
            if name in shape.members:
                _walk(shape.members[name], item, f"{where}.{name}", problems)
    elif shape.type_name == "list" and isinstance(value, list):
        for n, item in enumerate(value):
            _walk(shape.member, item, f"{where}[{n}]", problems)
    elif shape.type_name == "map" and isinstance(value, dict):
        for key, item in value.items():
            _walk(shape.key, key, f"{where} key", problems)
            _walk(shape.value, item, f"{where}.{key}", problems)
    elif shape.type_name == "string" and isinstance(value, str):
        enum = getattr(shape, "enum", None) or []
        if enum and value not in enum:
            problems.append(f"{where}: {value!r} is not one of SageMaker's values")
        if "max" in shape.metadata and len(value) > shape.metadata["max"]:
            problems.append(f"{where}: longer than {shape.metadata['max']}")
        pattern = shape.metadata.get("pattern")
        if pattern is not None and not compiled(pattern).fullmatch(value):
            problems.append(f"{where}: {value!r} does not match SageMaker's pattern {pattern}")
    elif (
        shape.type_name in ("integer", "long")
        and isinstance(value, int)
        and value > shape.metadata.get("max", value)
    ):
        problems.append(f"{where}: {value} is over {shape.metadata['max']}")


def plan(job: TransformJob, *, model: TransformModel | None, model_name: str | None) -> list[Call]:
    """The calls, in order: (a model,) the transform job, then its description; each request
    checked against botocore's sagemaker model first."""
    job.validate()
    if (model is None) == (model_name is None):
        raise TransformError("give either --model-name or --image, --model-data and --role")
    calls = []
    if model is not None:
        create = model.request()
        model_name = create["ModelName"]
        calls.append(
            Call("sagemaker", "create_model", create, "skipped when a model of this name exists")
        )
    assert model_name is not None
    request = job.request(model_name)
    calls.append(Call("sagemaker", "create_transform_job", request))
    for call in calls:
        check_against_model(call.operation, call.params)
    calls.append(
        Call(
            "sagemaker",
            "describe_transform_job",
            {"TransformJobName": request["TransformJobName"]},
            "polled until Completed or Failed with --wait",
        )
    )
    return calls


def print_plan(calls: list[Call], out: TextIO) -> None:
    for number, call in enumerate(calls, start=1):
        out.write(json.dumps({"step": number, **call.describe()}) + "\n")


def run(
    calls: list[Call],
    *,
    region: str,
    endpoint_url: str | None,
    wait: bool,
    poll_s: float = 30.0,
    log: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Make the calls; the job's description (its last, with ``wait``)."""
    import botocore.session
    from botocore.exceptions import ClientError

    sagemaker = botocore.session.get_session().create_client(
        "sagemaker", region_name=region, endpoint_url=endpoint_url
    )
    try:
        for call in calls[:-1]:
            if call.operation == "create_model":
                try:
                    sagemaker.describe_model(ModelName=call.params["ModelName"])
                    log(f"model {call.params['ModelName']} exists")
                    continue
                except ClientError as exc:
                    if exc.response.get("Error", {}).get("Code") != "ValidationException":
                        raise
            getattr(sagemaker, call.operation)(**call.params)
            log(f"{call.operation}: done")
        describe = calls[-1]
        while True:
            found: dict[str, Any] = sagemaker.describe_transform_job(**describe.params)
            if not wait or found["TransformJobStatus"] in {"Completed", "Failed", "Stopped"}:
                found.pop("ResponseMetadata", None)
                return found
            log(f"{found['TransformJobName']}: {found['TransformJobStatus']}")
            time.sleep(poll_s)
    finally:
        sagemaker.close()
