"""`arbiter local` as one thing: its ports follow one base, a busy one is refused in one line before
a model loads, "up" is said once the parts answer, a part that dies stops the stack, and Ctrl-C or
SIGTERM stops it at any moment, the example job's wait included (issue 37, items 1, 3, 4, 6)."""

from __future__ import annotations

import argparse
import os
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
    with plan(LocalSettings(**settings), serve=True, runtime=True, work=True, moto=True) as ports:
        return [part.port for part in ports.parts()]


def test_every_port_follows_the_base_and_two_bases_share_none() -> None:
    a, b = free_block(), free_block()
    assert _ports(port=a) == [a, a + 1, a + 2, a + 3]
    assert _ports(port=b) == [b, b + 1, b + 2, b + 3]
    settings = LocalSettings(port=b)
    with plan(settings, serve=True, runtime=True, work=True, moto=True) as stack:
        assert container_url(settings, stack) == f"http://127.0.0.1:{b}"  # its own container


def test_the_parts_are_told_their_ports_and_the_runtime_its_own_container() -> None:
    b = free_block()
    settings = LocalSettings(port=b)
    with plan(settings, serve=True, runtime=True, work=True, moto=True) as stack:
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


def test_the_ports_are_held_from_the_plan_so_a_second_stack_is_refused_at_once() -> None:
    """The plan claims the ports and keeps them until the parts take them over, so a second
    stack's plan a moment later is refused, not passed (before: checked, then let go)."""
    a = free_block()
    settings = LocalSettings(port=a)
    with plan(settings, serve=True, runtime=True, work=True, moto=True) as first:
        assert all(part.sock is not None for part in first.parts())
        with pytest.raises(ArbiterError) as refused:
            plan(settings, serve=False, runtime=True, work=False, moto=False)
        assert f"port {a + 1}" in refused.value.message and "in use" in refused.value.message
    with plan(settings, serve=False, runtime=True, work=False, moto=False) as again:
        assert again.runtime is not None and again.runtime.port == a + 1


def test_a_part_adopts_the_socket_its_stack_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    from arbiter.ports import bind, handed_down

    a = free_block()
    with plan(LocalSettings(port=a), serve=False, runtime=True, work=False, moto=False) as stack:
        assert stack.runtime is not None and stack.runtime.sock is not None
        held = stack.runtime.sock
        monkeypatch.setenv("ARBITER_LISTEN_FDS", f"{a + 1}={held.dup().detach()}")
        assert handed_down([held]) == {"ARBITER_LISTEN_FDS": f"{a + 1}={held.fileno()}"}
        with bind("127.0.0.1", a + 1, "the runtime API", "ARBITER_RUNTIME_PORT") as adopted:
            assert adopted.getsockname()[1] == a + 1
            assert "ARBITER_LISTEN_FDS" not in os.environ  # adopted once, never twice
            with pytest.raises(ArbiterError):  # a second bind is a bind: the port is taken
                bind("127.0.0.1", a + 1, "the runtime API", "ARBITER_RUNTIME_PORT").close()


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


def test_two_stacks_started_together_on_one_base_one_is_refused_in_one_line() -> None:
    """Started 0.2 s apart, the stack that claims the ports second exits in one line, status 2,
    within 20 s, and the other comes up (before: moto's server thread could not bind and the second
    stack waited forever; Ctrl-C then printed a traceback). Which one claims first is the kernel's
    choice: the first started usually, the second under load."""
    base = free_block()
    env = local_env(ARBITER_LOCAL_STATE_DIR="")
    args = ["--port", str(base), "--no-serve"]
    stacks = [Local(args, env)]
    time.sleep(0.2)
    stacks.append(Local(args, env))
    started = time.monotonic()
    try:
        while all(s.popen.poll() is None for s in stacks) and time.monotonic() - started < 20:
            time.sleep(0.1)
        took = time.monotonic() - started
        refused = [s for s in stacks if s.popen.poll() is not None]
        assert len(refused) == 1, f"{took:.1f} s\n" + "\n---\n".join(s.text() for s in stacks)
        running = next(s for s in stacks if s is not refused[0])
        running.wait_for(lambda line: "arbiter local is up" in line)
        assert running.popen.poll() is None, running.text()
    finally:
        codes = [s.close() for s in stacks]
    lines = refused[0].text().strip().splitlines()
    assert refused[0].popen.returncode == 2, refused[0].text()
    assert len(lines) == 1 and "in use (another stack?)" in lines[0], lines
    assert codes[stacks.index(running)] == 0, running.text()


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name
)
def test_a_signal_stops_the_stack_while_it_waits_for_the_example_job(
    sig: signal.Signals, tmp_path: object
) -> None:
    """The worker's engine takes 60 s a decision, so the example job is still running when the
    signal comes: the stack stops within 10 s, its parts with it, status 0 (before: SIGINT and
    SIGTERM were ignored for up to 15 minutes). SIGHUP goes to the whole job, as a shell sends it
    when its terminal closes (before: each process died of it, the job's message left held)."""
    env = local_env(ARBITER_FAKE_DELAY_S="60")
    stack = Local(
        ["--port", "0", "--no-serve", "--no-runtime", "--submit", "examples/job.jsonl"], env
    )
    try:
        stack.wait_for(lambda line: "arbiter local is up" in line)
        stack.wait_for(lambda line: line.startswith("waiting for s3://"))
        time.sleep(1.0)  # the job is taken, its first chunk computing
        if sig == signal.SIGHUP:
            stack.signal_group(sig)
        else:
            stack.popen.send_signal(sig)
        started = time.monotonic()
        code = stack.popen.wait(timeout=30)
        took = time.monotonic() - started
    finally:
        stack.close()
    assert code == 0, stack.text()
    assert took < 10, f"{took:.1f} s\n{stack.text()}"
    assert "pool.stopped" in stack.text()


def _gone(group: int, within_s: float) -> bool:
    """Whether every process of ``group`` has exited within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.real_model
def test_a_stop_while_the_model_loads_ends_every_process_within_8_s() -> None:
    """Ctrl-C (SIGINT to the job) while the container loads the bundled model, in its read check
    (2-13 s here): the load is cancelled, every process gone within 8 s, status 0 (before: the
    container finished its load first, 23 s with the 1.5B, and was killed at the drain deadline,
    status 1)."""
    stack = Local(["--port", "0", "--no-runtime"], local_env())  # the pool's engine: a fake one
    try:
        stack.wait_for(lambda line: "read_check_started" in line)
        stack.signal_group(signal.SIGINT)
        started = time.monotonic()
        code = stack.popen.wait(timeout=60)
        gone = _gone(stack.popen.pid, 60)
        took = time.monotonic() - started
    finally:
        stack.close()
    text = stack.text()
    assert gone and took < 8, f"{took:.1f} s\n{text}"
    assert code in (0, 130), text
    assert "model_load_cancelled" in text and "model_loaded" not in text, text
    assert "Traceback" not in text, text


@pytest.mark.real_model
def test_the_example_jobs_last_line_names_this_stacks_own_container() -> None:
    """`--submit`'s last line says where to curl: this stack's container, not localhost:8080
    whatever the port."""
    base = free_block()
    args = ["--port", str(base), "--no-runtime", "--submit", "examples/job.jsonl"]
    stack = Local(args, local_env(ARBITER_LOCAL_STATE_DIR=""))
    try:
        last = stack.wait_for(lambda line: line.startswith("the stack keeps running"), 300)
    finally:
        code = stack.close()
    assert f"(curl http://127.0.0.1:{base}/ping)" in last and ":8080" not in last, last
    assert "job summary:" in stack.text() and code == 0, stack.text()


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


def test_the_stacks_own_lines_outlive_a_closed_terminal() -> None:
    """A write the closed terminal (here: a pipe nobody reads) refuses sends that stream and what
    follows to /dev/null, instead of raising in the middle of a stop."""
    import io

    from worker.local_terminal import Outliving

    read, write = os.pipe()
    os.close(read)
    stream = io.TextIOWrapper(io.FileIO(write, "w"), line_buffering=False)
    out = Outliving(stream)
    out.write("arbiter local: stopping\n")
    out.flush()  # EPIPE
    assert out.lost
    out.write("kept the local S3 + SQS state\n")
    out.flush()
    assert os.readlink(f"/proc/self/fd/{write}") == os.devnull
    stream.close()
