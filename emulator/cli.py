"""`arbiter runtime` (the SageMaker Runtime API in front of a container) and `arbiter transform`
(a Batch Transform job: its data plane here, or ``--aws`` the real ``CreateTransformJob``).

Imports stay light: ``arbiter.cli`` imports this module to build the parser.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any


def cmd_runtime(args: argparse.Namespace) -> int:
    from emulator.serve import serve
    from emulator.settings import RuntimeSettings

    updates = {
        k: v
        for k, v in {
            "port": args.port,
            "endpoint_name": args.endpoint_name,
            "aws": True if args.aws else None,
        }.items()
        if v is not None
    }
    return serve(RuntimeSettings().model_copy(update=updates))


def _job(args: argparse.Namespace) -> Any:
    from infra.transform import TransformJob

    return TransformJob(
        input_uri=args.input,
        output_uri=args.output,
        name=args.job_name or "",
        data_type=args.data_type,
        content_type=args.content_type,
        accept=args.accept,
        split_type=args.split_type,
        compression=args.compression,
        batch_strategy=args.batch_strategy,
        max_payload_mb=args.max_payload_mb,
        max_concurrent_transforms=args.max_concurrent_transforms,
        assemble_with=args.assemble_with,
        input_filter=args.input_filter,
        output_filter=args.output_filter,
        join_source=args.join_source,
        invocations_timeout_s=args.invocations_timeout,
        invocations_max_retries=args.invocations_max_retries,
        instance_type=args.instance_type,
        instance_count=args.instance_count,
    )


def cmd_transform(args: argparse.Namespace) -> int:
    from infra.deploy import DeployError  # TransformError's base; the image rule raises it

    try:
        job = _job(args)
        if args.aws:
            return _aws(args, job)
        from emulator.dataprocessing import DataProcessing

        job.validate()  # what is wrong with the job first, then where it would run
        DataProcessing.of(job)
        _local_store_named()
        return asyncio.run(_local(args, job))
    except DeployError as exc:
        print(f"arbiter transform: refused: {exc}", file=sys.stderr)
        return 2


def _local_store_named() -> None:
    """A transform run here reads and writes the S3 that ARBITER_AWS_ENDPOINT_URL names; without
    it, the caller's real S3. As `arbiter runtime` does, that takes an explicit opt-in
    (ARBITER_RUNTIME_AWS=true), else one line and status 2 before anything is read."""
    from emulator.settings import RuntimeSettings
    from infra.deploy import DeployError

    settings = RuntimeSettings()
    if not settings.aws_endpoint_url and not settings.aws:
        raise DeployError(
            "no ARBITER_AWS_ENDPOINT_URL: run here, the job would read and write S3 in your AWS "
            "account; set it to the local stack's S3 (`arbiter local` prints it), or "
            "ARBITER_RUNTIME_AWS=true to mean your account's, or pass --aws to run the job on "
            "SageMaker"
        )


def _aws(args: argparse.Namespace, job: Any) -> int:
    from infra import transform

    model = None
    if args.image or args.model_data or args.role:
        model = transform.TransformModel(
            image=args.image or "", model_data=args.model_data or "", role_arn=args.role or ""
        )
    calls = transform.plan(job, model=model, model_name=args.model_name)
    if args.dry_run:
        transform.print_plan(calls, sys.stdout)
        return 0
    found = transform.run(
        calls,
        region=args.region,
        endpoint_url=args.endpoint_url,
        wait=args.wait,
        log=lambda line: print(f"arbiter transform: {line}", file=sys.stderr),
    )
    print(json.dumps(found, default=str, indent=2))
    return 0 if found.get("TransformJobStatus") != "Failed" else 1


async def _local(args: argparse.Namespace, job: Any) -> int:
    import aiohttp
    from aiobotocore.session import get_session

    from emulator.settings import RuntimeSettings
    from emulator.transform import run_transform

    settings = RuntimeSettings()
    url = args.container_url or settings.container_url
    async with (
        aiohttp.ClientSession() as http,
        get_session().create_client("s3", **settings.client_kwargs()) as s3,
    ):
        result = await run_transform(job, s3=s3, http=http, container_url=url)
    print(json.dumps(result.describe(), indent=2))
    return 0 if result.status == "Completed" else 1


def register(sub: Any) -> None:
    """Add ``runtime`` and ``transform`` to the ``arbiter`` parser."""
    runtime = sub.add_parser(
        "runtime",
        help="the SageMaker Runtime API (InvokeEndpoint, async, response streams) on :8081, "
        "in front of `arbiter serve` (`arbiter local` starts it)",
    )
    runtime.add_argument("--port", type=int, default=None, help="ARBITER_RUNTIME_PORT (8081)")
    runtime.add_argument(
        "--endpoint-name", default=None, help="ARBITER_RUNTIME_ENDPOINT_NAME (arbiter)"
    )
    runtime.add_argument(
        "--aws",
        action="store_true",
        help="without ARBITER_AWS_ENDPOINT_URL, use real AWS in your account (refused otherwise)",
    )
    runtime.set_defaults(func=cmd_runtime)

    tr = sub.add_parser(
        "transform",
        help="a Batch Transform job over S3: run here against the local container, or --aws",
        description="Every object under INPUT becomes OUTPUT/<key>.out, as Batch Transform does. "
        "Locally the container is ARBITER_RUNTIME_CONTAINER_URL (`arbiter local`'s serve) and S3 "
        "is ARBITER_AWS_ENDPOINT_URL; --aws creates the real job (--dry-run prints the calls).",
    )
    tr.add_argument(
        "input",
        help="s3://BUCKET/PREFIX: every object under it is an input (--data-type ManifestFile: "
        "the manifest listing them)",
    )
    tr.add_argument("output", help="s3://BUCKET/PREFIX for the .out objects")
    tr.add_argument("--job-name", default=None)
    tr.add_argument(
        "--data-type",
        default="S3Prefix",
        choices=["S3Prefix", "ManifestFile", "AugmentedManifestFile"],
        help="S3DataType (AugmentedManifestFile is refused: not compatible with batch transform)",
    )
    tr.add_argument("--content-type", default="application/jsonlines")
    tr.add_argument("--accept", default="application/jsonlines")
    tr.add_argument("--split-type", default="Line", choices=["None", "Line"])
    tr.add_argument("--compression", default="None", choices=["None", "Gzip"])
    tr.add_argument(
        "--batch-strategy",
        default=None,
        choices=["MultiRecord", "SingleRecord"],
        help="default: the container's",
    )
    tr.add_argument(
        "--max-payload-mb", type=int, default=None, help="default: the container's, else 6"
    )
    tr.add_argument(
        "--max-concurrent-transforms",
        type=int,
        default=None,
        help="default: the container's, else 1",
    )
    tr.add_argument("--assemble-with", default="Line", choices=["None", "Line"])
    tr.add_argument(
        "--input-filter", default=None, help="DataProcessing.InputFilter, a JSONPath (default $)"
    )
    tr.add_argument(
        "--output-filter", default=None, help="DataProcessing.OutputFilter, a JSONPath (default $)"
    )
    tr.add_argument(
        "--join-source",
        default=None,
        choices=["Input", "None"],
        help="DataProcessing.JoinSource: Input adds each answer to its record as SageMakerOutput",
    )
    tr.add_argument(
        "--invocations-timeout", type=int, default=600, help="seconds per mini-batch (1-3600)"
    )
    tr.add_argument("--invocations-max-retries", type=int, default=3, help="0-3")
    tr.add_argument(
        "--container-url", default=None, help="local: the container (default http://127.0.0.1:8080)"
    )
    aws = tr.add_argument_group("--aws: the real CreateTransformJob")
    aws.add_argument("--aws", action="store_true", help="create the job on SageMaker")
    aws.add_argument(
        "--dry-run", action="store_true", help="print the calls as JSON lines; call nothing"
    )
    aws.add_argument(
        "--model-name",
        default=None,
        help="an existing SageMaker model (e.g. the serving stack's ModelName)",
    )
    aws.add_argument(
        "--image", default=None, help="or: make a model from this ECR image, REPO@sha256:<64 hex>"
    )
    aws.add_argument("--model-data", default=None, help="... this s3://.../model.tar.gz")
    aws.add_argument(
        "--role", default=None, help="... and this execution role ARN (reads input, writes output)"
    )
    aws.add_argument("--instance-type", default="ml.c6i.2xlarge")
    aws.add_argument("--instance-count", type=int, default=1)
    aws.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"))
    aws.add_argument("--endpoint-url", default=None, help="an AWS endpoint (moto, LocalStack)")
    aws.add_argument("--wait", action="store_true", help="poll until the job ends")
    tr.set_defaults(func=cmd_transform)
