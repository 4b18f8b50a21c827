"""`arbiter package-model` and `arbiter deploy`.

Imports stay light: ``arbiter.cli`` imports this module to build the parser.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def cmd_package_model(args: argparse.Namespace) -> int:
    from infra.package_model import PackageError, package_model

    try:
        package = package_model(
            Path(args.gguf),
            Path(args.out),
            expected_sha256=args.expected_sha256,
            source=args.source,
            revision=args.revision,
            profile=Path(args.profile) if args.profile else None,
            loras=[_lora(value) for value in args.lora or []],
            read_check=args.read_check,
        )
    except PackageError as exc:
        print(f"arbiter package-model: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(package.manifest, indent=2), file=sys.stderr)
    print(f"arbiter package-model: {package.read_check}", file=sys.stderr)
    print(f"wrote {package.archive} ({package.bytes} bytes)", file=sys.stderr)
    # sha256sum's format, so `sha256sum -c` can check the archive after a copy.
    print(f"{package.sha256}  {package.archive}")
    return 0


def _lora(value: str) -> tuple[Path, float]:
    """``FILE[:SCALE]`` as --lora takes it (llama-server's --lora-scaled form)."""
    path, sep, scale = value.rpartition(":")
    if sep:
        try:
            return Path(path), float(scale)
        except ValueError:
            pass
    return Path(value), 1.0


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def cmd_deploy(args: argparse.Namespace) -> int:
    from infra.deploy import DeployConfig, DeployError
    from infra.deploy_run import deploy

    config = DeployConfig(
        stack=args.stack,
        bucket=args.bucket,
        image=args.image,
        model=args.model,
        region=args.region,
        mode=args.mode,
        accelerator=args.accelerator,
        max_in_flight=args.max_in_flight,
        endpoint_max_instances=args.endpoint_max_instances,
        workers=not args.no_workers,
        subnets=_csv(args.subnets),
        security_groups=_csv(args.security_groups),
        assign_public_ip=args.assign_public_ip,
        worker_max_tasks=args.worker_max_tasks,
        worker_processes=args.worker_processes,
        endpoint_url=args.endpoint_url,
        poll_s=args.poll,
        read_check=args.read_check,
    )
    try:
        return deploy(
            config,
            dry_run=args.dry_run,
            out=sys.stdout,
            log=lambda line: print(f"arbiter deploy: {line}", file=sys.stderr),
        )
    except DeployError as exc:
        print(f"arbiter deploy: refused: {exc}", file=sys.stderr)
        return 2


def register(sub: Any) -> None:
    """Add ``package-model`` and ``deploy`` to the ``arbiter`` parser."""
    pkg = sub.add_parser(
        "package-model",
        help="write model.tar.gz: a GGUF and its checksum manifest, for SageMaker and the workers",
    )
    pkg.add_argument("--gguf", required=True, help="the .gguf file to package")
    pkg.add_argument("--out", required=True, help="archive to write (.tar.gz; never overwritten)")
    pkg.add_argument(
        "--expected-sha256", default=None, help="stop unless the GGUF has this sha256 (hex)"
    )
    pkg.add_argument(
        "--source", default=None, help="where the GGUF came from (URL); with --revision"
    )
    pkg.add_argument("--revision", default=None, help="the source's revision (commit, tag)")
    pkg.add_argument("--profile", default=None, help="a prompt profile (TOML) to pack with it")
    pkg.add_argument(
        "--lora",
        action="append",
        metavar="FILE[:SCALE]",
        help="a LoRA adapter (GGUF) to pack and apply at SCALE (default 1); repeatable",
    )
    _read_check_argument(pkg, "before anything is written")
    pkg.set_defaults(func=cmd_package_model)

    dep = sub.add_parser(
        "deploy",
        help="create or update the CloudFormation stacks (S3/SQS, SageMaker endpoint, ECS workers)",
        description="Deploys infra/cloudformation/data.yaml, uploads the model archive, deploys "
        "infra/cloudformation/serving.yaml. See infra/README.md.",
    )
    dep.add_argument("--stack", required=True, help="name prefix: <stack>-data, <stack>-serving")
    dep.add_argument("--bucket", required=True, help="data bucket name (globally unique)")
    dep.add_argument("--image", required=True, help="ECR image by digest: REPO@sha256:<64 hex>")
    dep.add_argument(
        "--model", required=True, help="model.tar.gz from package-model, or s3://BUCKET/models/..."
    )
    dep.add_argument("--region", default="us-east-1")
    dep.add_argument("--mode", choices=["realtime", "async", "none"], default="async")
    dep.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    dep.add_argument(
        "--max-in-flight", type=int, default=1, help="ARBITER_MAX_IN_FLIGHT = async concurrency"
    )
    dep.add_argument("--endpoint-max-instances", type=int, default=2)
    dep.add_argument("--no-workers", action="store_true", help="no ECS worker pool")
    dep.add_argument("--subnets", default="", help="comma-separated subnet ids (workers)")
    dep.add_argument("--security-groups", default="", help="comma-separated security groups")
    dep.add_argument("--assign-public-ip", action="store_true", help="public subnets without NAT")
    dep.add_argument("--worker-max-tasks", type=int, default=4)
    dep.add_argument("--worker-processes", type=int, default=1)
    dep.add_argument("--endpoint-url", default=None, help="AWS endpoint (LocalStack, moto)")
    dep.add_argument("--poll", type=int, default=15, help="seconds between stack status polls")
    dep.add_argument(
        "--dry-run", action="store_true", help="print every AWS call as JSON lines; call nothing"
    )
    _read_check_argument(dep, "on the local archive, before any AWS call (--dry-run too)")
    dep.set_defaults(func=cmd_deploy)


def _read_check_argument(parser: Any, when: str) -> None:
    parser.add_argument(
        "--read-check",
        choices=["refuse", "warn", "off"],
        default="refuse",
        help=f"load the model as it will be served and run the engine's read check {when}: a "
        "package that would refuse to start is refused here (warn: packed anyway)",
    )
