"""`arbiter local` starts `arbiter runtime` beside the container: its line names the URL and the
endpoint, boto3 reaches the container through it, SIGTERM stops it with the rest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests import ROOT
from tests.emulator.support import BUCKET, aws, exists, poll_object, runtime, stand_in
from tests.environ import environ_without
from tests.fakes import decision_body
from tests.ports import free_block, free_port
from tests.worker.local_stack import Local, local_env

pytestmark = pytest.mark.timeout(300)


@pytest.mark.real_model
def test_arbiter_local_serves_the_runtime_api_in_front_of_its_container() -> None:
    serve_port = free_port()
    env = environ_without("ARBITER_", "AWS_")
    env.update(
        PYTHONPATH=str(ROOT),
        ARBITER_PORT=str(serve_port),
        ARBITER_RUNTIME_PORT="0",
        ARBITER_RUNTIME_CONTAINER_URL=f"http://127.0.0.1:{serve_port}",
        ARBITER_N_THREADS="2",
    )
    local = subprocess.Popen(
        [sys.executable, "-m", "arbiter", "local", "--moto-port", "0", "--no-work"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    assert local.stdout is not None
    out = local.stdout
    reader = threading.Thread(target=lambda: lines.extend(iter(out.readline, "")), daemon=True)
    reader.start()
    try:
        url = ""
        deadline = time.monotonic() + 120
        while not url and time.monotonic() < deadline:
            for line in list(lines):
                if line.startswith("SageMaker runtime API: "):
                    url = line.split()[3]
                    assert "endpoint name: arbiter" in line
            time.sleep(0.1)
        assert url.startswith("http://127.0.0.1:"), "".join(lines)
        client = runtime(url)
        body = json.dumps({"decision": decision_body("local-1")})
        while True:  # the container starts, then loads its model: ModelError 503 until then
            try:
                got = client.invoke_endpoint(
                    EndpointName="arbiter", ContentType="application/json", Body=body
                )
                break
            except client.exceptions.ModelNotReadyException:
                pass  # nothing listens at the container's port yet (botocore retried it, too)
            except client.exceptions.ModelError as error:
                assert error.response["OriginalStatusCode"] == 503
                assert time.monotonic() < deadline + 120, "the container never became ready"
                time.sleep(0.5)
        assert json.loads(got["Body"].read())["result"]["id"] == "local-1"
    finally:
        local.send_signal(signal.SIGTERM)
        code = local.wait(timeout=90)
        reader.join(timeout=10)
        assert local.stdout is not None
        local.stdout.close()
    assert code == 0, "".join(lines)


def _children(pid: int) -> list[int]:
    return [int(n) for n in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _stop(stack: Local, how: str) -> None:
    """Each way a stack is stopped: Ctrl-C (the terminal signals the whole job), twice; `kill`
    (SIGTERM to `arbiter local` alone); the terminal closed (SIGHUP to the job, its output gone);
    a part that dies (SIGKILL to the runtime API)."""
    if how == "ctrl-c":
        stack.signal_group(signal.SIGINT)
    elif how == "ctrl-c twice":
        stack.signal_group(signal.SIGINT)
        time.sleep(0.3)
        stack.signal_group(signal.SIGINT)
    elif how == "sigterm":
        stack.popen.send_signal(signal.SIGTERM)
    elif how == "terminal closed":
        stack.hang_up()
    else:
        assert how == "a part dies"
        (runtime_pid,) = _children(stack.popen.pid)  # --no-serve --no-work: the runtime alone
        os.kill(runtime_pid, signal.SIGKILL)


STOPS = ["ctrl-c", "ctrl-c twice", "sigterm", "terminal closed", "a part dies"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", STOPS)
def test_async_requests_accepted_before_a_stop_are_answered_after_the_restart(
    tmp_path: Path, how: str
) -> None:
    """Three requests accepted (202) while the container is away, the stack stopped each way a
    stack is stopped, started again with its container: all three outputs written, and a job
    dropped before the stop too (issue 37 item 2: lost with the in-process moto server; a closed
    terminal's SIGHUP still lost them, and SIGTERM to the job too)."""
    base = free_block()
    container_port = free_port()
    env = local_env(
        ARBITER_LOCAL_STATE_DIR=str(tmp_path),
        ARBITER_RUNTIME_CONTAINER_URL=f"http://127.0.0.1:{container_port}",
    )
    args = ["--port", str(base), "--no-serve", "--no-work"]
    moto = f"http://127.0.0.1:{base + 2}"
    first = Local(args, env, terminal=how == "terminal closed")
    try:
        first.wait_for(lambda line: "arbiter local is up" in line)
        s3 = aws("s3", moto)
        client = runtime(f"http://127.0.0.1:{base + 1}")
        accepted = []
        for n in range(3):
            key = f"async/input/r{n}.json"
            s3.put_object(Bucket=BUCKET, Key=key, Body=json.dumps({"n": n}).encode())
            accepted.append(
                client.invoke_endpoint_async(
                    EndpointName="arbiter-async",
                    ContentType="application/json",
                    InputLocation=f"s3://{BUCKET}/{key}",
                )
            )
        s3.put_object(Bucket=BUCKET, Key="incoming/kept.jsonl", Body=b"{}\n")  # a job, queued
        time.sleep(1.0)
        assert not any(exists(s3, got["OutputLocation"]) for got in accepted)  # no container
        _stop(first, how)
        code = first.popen.wait(timeout=30)
    finally:
        first.close()
    if how in ("ctrl-c", "sigterm", "terminal closed"):
        assert code == 0, first.text()
    if how != "terminal closed":  # its lines went to the closed terminal
        assert "kept the local S3 + SQS state" in first.text()
    with stand_in(port=container_port) as (fake, _):
        second = Local(args, env)
        try:
            second.wait_for(lambda line: "S3 + SQS state: restored from" in line)
            s3 = aws("s3", moto)
            try:
                outputs = [poll_object(s3, got["OutputLocation"]) for got in accepted]
            except Exception as exc:
                raise AssertionError(first.text() + "\n---\n" + second.text()) from exc
            assert outputs == [b'{"ok": true}'] * 3
            jobs = aws("sqs", moto)
            url = jobs.get_queue_url(QueueName="arbiter-jobs")["QueueUrl"]
            bodies = [
                m["Body"]
                for _ in range(5)
                for m in jobs.receive_message(
                    QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1
                ).get("Messages", [])
            ]
            assert any("kept.jsonl" in body for body in bodies), bodies
        finally:
            assert second.close() == 0, second.text()
    assert sorted(json.loads(seen["body"])["n"] for seen in fake.seen) == [0, 1, 2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("state", ["not kept", "cannot be written"])
def test_a_stop_that_cannot_keep_the_state_names_each_request_it_loses(
    tmp_path: Path, state: str
) -> None:
    """With the state not kept (ARBITER_LOCAL_STATE_DIR empty), or its file impossible to write,
    the stop names each accepted request lost with it (before: nothing was said; a failed save
    was a traceback)."""
    base = free_block()
    blocked = tmp_path / "state"
    env = local_env(
        ARBITER_LOCAL_STATE_DIR="" if state == "not kept" else str(blocked / "local"),
        ARBITER_RUNTIME_CONTAINER_URL=f"http://127.0.0.1:{free_port()}",  # nothing answers
    )
    stack = Local(["--port", str(base), "--no-serve", "--no-work"], env)
    try:
        stack.wait_for(lambda line: "arbiter local is up" in line)
        s3 = aws("s3", f"http://127.0.0.1:{base + 2}")
        client = runtime(f"http://127.0.0.1:{base + 1}")
        accepted = []
        for n in range(3):
            s3.put_object(Bucket=BUCKET, Key=f"async/input/r{n}.json", Body=b"{}")
            accepted.append(
                client.invoke_endpoint_async(
                    EndpointName="arbiter-async",
                    ContentType="application/json",
                    InputLocation=f"s3://{BUCKET}/async/input/r{n}.json",
                )
            )
        blocked.write_text("a file where the state's folder must go")
        stack.popen.send_signal(signal.SIGTERM)
        code = stack.popen.wait(timeout=30)
    finally:
        stack.close()
    text = stack.text()
    assert "Traceback" not in text, text
    assert "lost with it, 3 accepted and not yet answered" in text, text
    for got in accepted:
        assert f"async request {got['InferenceId']} (its output: {got['OutputLocation']})" in text
    assert code == (0 if state == "not kept" else 1), text


@pytest.mark.real_model
@pytest.mark.timeout(400)
def test_two_stacks_side_by_side_each_answer_with_their_own_model(tmp_path: Path) -> None:
    """Issue 37 items 3 and 6: two stacks moved by ARBITER_PORT alone run side by side; each
    runtime API calls its own stack's container (the second serves the same weights under another
    file name, so the answer says whose model it is)."""
    from arbiter.models import bundled_model

    second_model = tmp_path / "second-stack.gguf"
    second_model.symlink_to(bundled_model().path)
    stacks = []
    try:
        for model in (None, second_model):
            base = free_block()
            env = local_env(ARBITER_PORT=base, ARBITER_N_THREADS="1")
            if model is not None:
                env["ARBITER_MODEL"] = str(model)
            stacks.append((base, Local(["--no-work"], env)))
        files = []
        for base, stack in stacks:
            up = stack.wait_for(lambda line: "arbiter local is up" in line, within_s=300)
            said = stack.text()[: stack.text().index(up)]  # the load's steps, before "up"
            assert all(step in said for step in ("model_loading", "read_check_started")), said
            client = runtime(f"http://127.0.0.1:{base + 1}")
            got = client.invoke_endpoint(
                EndpointName="arbiter",
                ContentType="application/json",
                Body=json.dumps({"decision": decision_body(f"stack-{base}")}),
            )
            result = json.loads(got["Body"].read())["result"]
            assert result["id"] == f"stack-{base}"
            files.append(result["model"]["file"])
    finally:
        codes = [stack.close() for _, stack in stacks]
    assert files == [bundled_model().path.name, "second-stack.gguf"]
    assert codes == [0, 0], [stack.text() for _, stack in stacks]
