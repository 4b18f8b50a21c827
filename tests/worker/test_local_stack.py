"""`arbiter local` as one thing: its ports follow one base, a busy one is refused in one line before
a model loads, "up" is said once the parts answer, a part that dies stops the stack, and Ctrl-C or
SIGTERM stops it at any moment, the example job's wait included (issue 37, items 1, 3, 4, 6)."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arbiter.errors import ArbiterError
from tests import ROOT
from tests.ports import free_block
from tests.worker.local_stack import Local, local_env
from worker.local import _child_env, container_url
from worker.local_ports import LocalSettings, plan

pytestmark = pytest.mark.timeout(240)


def _ports(**settings: object) -> list[int]:
    ports = plan(LocalSettings(**settings), serve=True, runtime=True, work=True, moto=True)
    return [part.port for part in ports.parts()]


def test_every_port_follows_the_base_and_two_bases_share_none() -> None:
    a, b = free_block(), free_block()
    assert _ports(port=a) == [a, a + 1, a + 2, a + 3]
    assert _ports(port=b) == [b, b + 1, b + 2, b + 3]
    settings = LocalSettings(port=b)
    stack = plan(settings, serve=True, runtime=True, work=True, moto=True)
    assert container_url(settings, stack) == f"http://127.0.0.1:{b}"  # its own container


def test_the_parts_are_told_their_ports_and_the_runtime_its_own_container() -> None:
    b = free_block()
    settings = LocalSettings(port=b)
    stack = plan(settings, serve=True, runtime=True, work=True, moto=True)
    args = argparse.Namespace(processes=None)
    env = _child_env(args, settings, stack, f"http://127.0.0.1:{b + 2}")
    assert env["ARBITER_PORT"] == str(b) and env["ARBITER_RUNTIME_PORT"] == str(b + 1)
    assert env["ARBITER_METRICS_PORT"] == str(b + 3)
    assert env["ARBITER_AWS_ENDPOINT_URL"] == f"http://127.0.0.1:{b + 2}"
    assert env["ARBITER_RUNTIME_CONTAINER_URL"] == f"http://127.0.0.1:{b}"


def test_a_component_variable_still_wins_and_base_zero_picks_free_ports() -> None:
    a = free_block()
    runtime = free_block(1)
    assert _ports(port=a, runtime_port=runtime) == [a, runtime, a + 2, a + 3]
    anywhere = _ports(port=0)
    assert 0 not in anywhere and len(set(anywhere)) == 4
    # Handed to the parts, which bind them seconds later: none where an outgoing connection
    # takes its source port meanwhile (CI: a runtime API refused the port its stack had found).
    low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert not [p for p in anywhere if low <= p <= high], anywhere


def test_a_busy_port_is_refused_naming_the_part_and_the_base() -> None:
    a = free_block()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", a + 3))
        busy.listen()
        with pytest.raises(ArbiterError) as refused:
            _ports(port=a)
    said = refused.value.message
    assert f"port {a + 3}" in said and "worker pool's metrics" in said and "in use" in said
    assert "ARBITER_PORT" in said


@pytest.mark.real_model
@pytest.mark.parametrize("command", ["local", "serve", "work"])
def test_a_busy_port_is_one_line_before_any_model_loads(command: str) -> None:
    """The real default model's files are checked (milliseconds), then the port; the model is
    never loaded: no `model_loading` line, one line on stderr, status 2."""
    a = free_block()
    taken = {"local": a + 1, "serve": a, "work": a + 3}[command]
    argv = {
        "local": ["local", "--port", str(a), "--no-work"],
        "serve": ["serve", "--port", str(a)],
        "work": ["work", "--metrics-port", str(a + 3)],
    }[command]
    env = local_env(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    env.pop("ARBITER_WORKER_ENGINE_FACTORY")  # the real engine: it must not load
    env["ARBITER_AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"  # work: nothing is called
    if command == "local":
        env.pop("ARBITER_AWS_ENDPOINT_URL")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", taken))
        busy.listen()
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "arbiter", *argv],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(taken) in lines[0] and "in use" in lines[0], done.stderr
    assert "model_loading" not in done.stdout + done.stderr
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_stack_while_it_waits_for_the_example_job(
    sig: signal.Signals, tmp_path: object
) -> None:
    """The worker's engine takes 60 s a decision, so the example job is still running when the
    signal comes: the stack stops within 10 s, its parts with it, status 0 (before: SIGINT and
    SIGTERM were ignored for up to 15 minutes)."""
    env = local_env(ARBITER_FAKE_DELAY_S="60")
    stack = Local(
        ["--port", "0", "--no-serve", "--no-runtime", "--submit", "examples/job.jsonl"], env
    )
    try:
        stack.wait_for(lambda line: "arbiter local is up" in line)
        stack.wait_for(lambda line: line.startswith("waiting for s3://"))
        time.sleep(1.0)  # the job is taken, its first chunk computing
        stack.popen.send_signal(sig)
        started = time.monotonic()
        code = stack.popen.wait(timeout=30)
        took = time.monotonic() - started
    finally:
        stack.close()
    assert code == 0, stack.text()
    assert took < 10, f"{took:.1f} s\n{stack.text()}"
    assert "pool.stopped" in stack.text()


def test_up_is_said_once_the_parts_answer_and_a_part_that_dies_stops_the_stack() -> None:
    env = local_env(ARBITER_RUNTIME_ENDPOINT_NAME="not_a_name")  # the runtime refuses to start
    stack = Local(["--port", "0", "--no-serve"], env)
    stack.popen.wait(timeout=90)
    code = stack.close()
    text = stack.text()
    assert code == 1, text
    assert "the SageMaker runtime API (arbiter runtime) exited with status" in text
    assert "arbiter local is up" not in text
    assert "arbiter local: stopping" in text  # the worker pool was stopped with it
    assert "S3 + SQS state: not kept between runs" in text  # moto on a port of the moment


def test_the_stack_says_up_only_once_each_part_answers() -> None:
    stack = Local(["--port", "0", "--no-serve"], local_env())
    try:
        up = stack.wait_for(lambda line: "arbiter local is up" in line)
        text = stack.text()
        before = text[: text.index(up)]
        assert "the worker pool (arbiter work) answers" in before
        assert "the SageMaker runtime API (arbiter runtime) answers" in before
        assert "worker.ready" in before
    finally:
        assert stack.close() == 0, stack.text()


async def test_the_job_queue_takes_changed_settings_and_keeps_its_messages(endpoint: str) -> None:
    """A kept state (or a queue made before) meets a changed ARBITER_VISIBILITY_TIMEOUT_S: the
    queue is given it, its messages stay (CreateQueue alone refused it, QueueAlreadyExists)."""
    from tests.aws import aws_clients, receive_all
    from tests.worker.support import settings_for
    from worker.stack import ensure_stack

    async with aws_clients(endpoint) as (s3, sqs):
        first = await ensure_stack(s3, sqs, settings_for(endpoint, visibility_timeout_s=30))
        await sqs.send_message(QueueUrl=first["queue_url"], MessageBody="kept")
        again = await ensure_stack(s3, sqs, settings_for(endpoint, visibility_timeout_s=90))
        got = await sqs.get_queue_attributes(
            QueueUrl=again["queue_url"], AttributeNames=["VisibilityTimeout"]
        )
        bodies = [m["Body"] for m in await receive_all(sqs, again["queue_url"])]
    assert again["queue_url"] == first["queue_url"]
    assert got["Attributes"]["VisibilityTimeout"] == "90"
    assert "kept" in bodies
