"""`arbiter bench transform`: the peak memory of `arbiter transform` over one large object.

Each case runs `arbiter transform` as a process of its own (its peak RSS read from ``wait4``) over
one object in moto's S3 (on 127.0.0.1, in this process), against a container that echoes its
request body back as it reads it (so what is measured is the transform's own memory, not a
model's). The baseline is the same command over a 1 MB object, in the same run: the interpreter and
its imports. The figure that matters is the growth over it, against the object's size: a transform
that held the object whole would grow by at least the object.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

# `--smoke` (make bench-smoke): the smallest size that runs every row.
SMOKE: dict[str, Any] = {"mb": 2}

MB = 1024 * 1024
BUCKET = "bench-transform"
_LINE = b'{"id": "%08d", "state": {"text": "' + b"x" * 200 + b'"}, "question": "q?"}\n'


@dataclass(frozen=True)
class Case:
    label: str
    flags: tuple[str, ...]


STREAMED = ("--max-payload-mb", "0")
CASES = (
    Case(
        "SplitType=None, MaxPayloadInMB=0 (streamed, chunked)", ("--split-type", "None", *STREAMED)
    ),
    Case(
        "SplitType=Line, MultiRecord, MaxPayloadInMB=0 (streamed, chunked)",
        ("--split-type", "Line", "--batch-strategy", "MultiRecord", *STREAMED),
    ),
    Case(
        "SplitType=Line, MultiRecord, MaxPayloadInMB=100 (mini-batches held, 1 at a time)",
        ("--split-type", "Line", "--batch-strategy", "MultiRecord", "--max-payload-mb", "100"),
    ),
)


def echo_app() -> web.Application:
    """A container whose answer is its request body, streamed back as it arrives."""

    async def invocations(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_type = request.content_type
        await response.prepare(request)
        async for chunk in request.content.iter_chunked(MB):
            await response.write(chunk)
        await response.write_eof()
        return response

    async def ping(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/ping", ping)
    app.router.add_post("/invocations", invocations)
    return app


@contextmanager
def served(app: web.Application) -> Iterator[str]:
    """``app`` on 127.0.0.1 from a thread of its own; yields its URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return int(runner.addresses[0][1])

    thread = threading.Thread(target=loop.run_forever, name="echo-container", daemon=True)
    thread.start()
    port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)


def object_of(size_mb: int) -> bytes:
    """JSON Lines of ~250-byte records, ``size_mb`` MiB (the last line cut to fit)."""
    count = size_mb * MB // len(_LINE) + 1
    return b"".join(_LINE % n for n in range(count))[: size_mb * MB]


# The child reports its own high-water mark: a forked child's ``ru_maxrss`` (wait4) starts from
# its parent's, which here holds moto and the object.
_RUN = (
    "import atexit, sys\n"
    "def hwm():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'):\n"
    "            sys.stderr.write('peak_rss_kb=' + line.split()[1] + '\\n')\n"
    "atexit.register(hwm)\n"
    "from arbiter.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def peak_rss_mb(args: list[str], env: dict[str, str]) -> tuple[int, float]:
    """Run ``arbiter ARGS`` as a process of its own: its exit status and peak RSS (VmHWM) in MiB."""
    done = subprocess.run(
        [sys.executable, "-c", _RUN, *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        check=False,
    )
    said = [x for x in done.stderr.decode().splitlines() if x.startswith("peak_rss_kb=")]
    return done.returncode, int(said[-1].split("=")[1]) / 1024 if said else float("nan")


def transform_env(endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_")}
    env.update(
        ARBITER_AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        ARBITER_LOG_JSON="true",
    )
    return env


def _moto() -> tuple[Any, str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def main(args: argparse.Namespace) -> int:
    import botocore.session

    server, endpoint = _moto()
    s3 = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    s3.create_bucket(Bucket=BUCKET)
    env = transform_env(endpoint)
    rows = []
    try:
        with served(echo_app()) as url:
            for case in CASES:
                measured = {}
                for size in (1, args.mb):
                    print(f"[bench transform] {case.label}: {size} MB", file=sys.stderr, flush=True)
                    key = f"in-{size}/object.jsonl"
                    s3.put_object(Bucket=BUCKET, Key=key, Body=object_of(size))
                    command = [
                        "transform",
                        f"s3://{BUCKET}/in-{size}/",
                        f"s3://{BUCKET}/out-{size}/",
                        "--max-concurrent-transforms",
                        "1",
                        "--container-url",
                        url,
                        *case.flags,
                    ]
                    code, rss = peak_rss_mb(command, env)
                    out = s3.head_object(Bucket=BUCKET, Key=f"out-{size}/object.jsonl.out")
                    if code != 0 or out["ContentLength"] < size * MB:
                        print(f"{case.label}: failed (exit {code})", file=sys.stderr)
                        return 1
                    measured[size] = rss
                    s3.delete_object(Bucket=BUCKET, Key=key)
                growth = measured[args.mb] - measured[1]
                rows.append((case.label, measured[1], measured[args.mb], growth))
    finally:
        server.stop()
    print(
        f"| case | peak RSS, 1 MB object | peak RSS, {args.mb} MB object | growth | growth / object |"
    )
    print("|---|---|---|---|---|")
    for label, base, big, growth in rows:
        print(
            f"| {label} | {base:.0f} MB | {big:.0f} MB | {growth:+.0f} MB | {growth / args.mb:.2f} |"
        )
    return 0
