"""`arbiter work`, `arbiter submit` and `arbiter local`.

Imports here stay light: ``arbiter.cli`` imports this module to build the parser.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any


def _settings(args: argparse.Namespace, **extra: Any) -> Any:
    from worker.settings import WorkerSettings

    overrides = {k: v for k, v in extra.items() if v is not None}
    return WorkerSettings(**overrides)


def cmd_work(args: argparse.Namespace) -> int:
    from arbiter.logging import configure
    from worker.pool import run_pool

    configure()
    settings = _settings(args, worker_processes=args.processes, metrics_port=args.metrics_port)
    _preflight(settings)
    return asyncio.run(run_pool(settings))


def _preflight(settings: Any) -> None:
    """What every worker would die of at once, refused before the pool spawns any (one line,
    status 2, instead of a crash loop): the real engine's files, and no AWS credentials at all
    (the credential chain is read; nothing is called)."""
    from botocore.exceptions import NoCredentialsError
    from botocore.session import get_session

    if (
        settings.worker_engine_factory
        == type(settings).model_fields["worker_engine_factory"].default
    ):
        from arbiter.engine import check_files
        from arbiter.settings import engine_from_environment

        check_files(engine_from_environment())
    if (
        "aws_access_key_id" not in settings.client_kwargs()
        and get_session().get_credentials() is None
    ):
        raise NoCredentialsError()


def cmd_submit(args: argparse.Namespace) -> int:
    from worker.submit import submit

    settings = _settings(args)
    summary = asyncio.run(
        submit(
            settings,
            Path(args.file),
            key=args.key,
            timeout_s=args.timeout,
            shard_lines=args.shard_lines,
        )
    )
    if summary is None:
        print(
            f"no summary after {args.timeout:.0f} s; the job may still be running", file=sys.stderr
        )
        return 2
    print(json.dumps(summary, indent=2))
    if "rejected" in summary:
        print(f"arbiter submit: the job was rejected: {summary['rejected']}", file=sys.stderr)
        return 1
    return 0


def cmd_check_fanout(args: argparse.Namespace) -> int:
    from worker.check import cmd_check_fanout as run

    return run(args)


def cmd_local(args: argparse.Namespace) -> int:
    from worker.local import run_local

    return run_local(args)


def register(sub: Any) -> None:
    """Add the worker subcommands to the ``arbiter`` parser."""
    work = sub.add_parser("work", help="run the batch worker pool (S3 jobs announced on SQS)")
    work.add_argument("--processes", type=int, default=None, help="ARBITER_WORKER_PROCESSES")
    work.add_argument("--metrics-port", type=int, default=None, help="ARBITER_METRICS_PORT")
    work.set_defaults(func=cmd_work)

    submit = sub.add_parser("submit", help="upload a job file, wait for it, print its summary")
    submit.add_argument("file", help="a .jsonl / .json job (optionally .gz)")
    submit.add_argument("--key", default=None, help="object key (default: input prefix + name)")
    submit.add_argument("--timeout", type=float, default=900.0, help="seconds to wait")
    submit.add_argument(
        "--shard-lines",
        type=int,
        default=None,
        help="split this job into shards of this many lines (x-amz-meta-arbiter-shard-lines), "
        "whatever the workers' ARBITER_SHARD_LINES",
    )
    submit.set_defaults(func=cmd_submit)

    check = sub.add_parser(
        "check-fanout",
        help="run a small split job on the deployed stack and verify what it left (docs/batch-jobs.md: "
        "What moto cannot prove)",
    )
    check.add_argument("--lines", type=int, default=240, help="decisions in the job")
    check.add_argument("--shard-lines", type=int, default=40, help="lines per shard")
    check.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait")
    check.add_argument("--keep", action="store_true", help="keep the job's objects afterwards")
    check.set_defaults(func=cmd_check_fanout)

    local = sub.add_parser(
        "local",
        help="moto S3+SQS, bucket, queues, notification, `serve`, `work` and `runtime` on this host",
        description="The whole stack on one machine. Its ports follow one base (ARBITER_PORT, "
        "8080): the container on it, the SageMaker runtime API on +1, S3 + SQS on +2, the "
        "worker metrics on +3. The S3 + SQS state is kept between runs "
        "(ARBITER_LOCAL_STATE_DIR); Ctrl-C, SIGTERM or a closed terminal stops everything.",
    )
    local.add_argument(
        "--port", type=int, default=None, help="the base port (ARBITER_PORT, 8080; 0: any free)"
    )
    local.add_argument(
        "--moto-port",
        type=int,
        default=None,
        help="the S3 + SQS server's port (ARBITER_LOCAL_MOTO_PORT; default base + 2; 0: any)",
    )
    local.add_argument(
        "--fresh",
        action="store_true",
        help="start with empty S3 and SQS: discard the state the last run kept",
    )
    local.add_argument("--processes", type=int, default=None, help="worker processes")
    local.add_argument("--no-serve", action="store_true", help="do not start `arbiter serve`")
    local.add_argument("--no-work", action="store_true", help="do not start `arbiter work`")
    local.add_argument(
        "--no-runtime", action="store_true", help="do not start `arbiter runtime` (port 8081)"
    )
    local.add_argument(
        "--submit",
        type=Path,
        default=None,
        metavar="FILE",
        help="once up, submit this job, print its summary and first results, keep running",
    )
    local.set_defaults(func=cmd_local)
