"""`arbiter local` starts `arbiter runtime` beside the container: its line names the URL and the
endpoint, boto3 reaches the container through it, SIGTERM stops it with the rest."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests import ROOT
from tests.emulator.support import runtime
from tests.environ import environ_without
from tests.fakes import decision_body

pytestmark = [pytest.mark.timeout(300), pytest.mark.real_model]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
