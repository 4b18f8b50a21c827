"""`IMAGE serve` as SageMaker runs it: /opt/ml/model mounted read-only, port 8080, SIGTERM on stop."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.container.podman_support import (
    IMAGE_UID,
    STOP_GRACE_S,
    Container,
    RunContainer,
    http,
    podman,
    record,
)
from tests.ports import free_port

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT = "gemma-3-270m-q4_k_m.gguf"


def decision(i: int) -> dict[str, object]:
    return {
        "id": f"d{i}",
        "state": f"Ticket {i}: the customer was charged twice for one order.",
        "question": "Which team should handle this ticket?",
        "options": [
            {"id": "billing", "description": "Billing and refunds"},
            {"id": "shipping", "description": "Shipping and delivery"},
            {"id": "access", "description": "Account access"},
        ],
    }


def published(port: int) -> tuple[str, ...]:
    """The container's 8080 on a host port, as SageMaker maps it."""
    return ("--publish", f"127.0.0.1:{port}:8080")


def bound_to(port: int) -> tuple[str, ...]:
    """The host's network, the port named by SAGEMAKER_BIND_TO_PORT (inference pipelines)."""
    return ("--network", "host", "--env", f"SAGEMAKER_BIND_TO_PORT={port}")


def model_at_opt_ml_model(model_dir: Path) -> tuple[str, ...]:
    return ("--volume", f"{model_dir}:/opt/ml/model:ro")


def assert_result(result: dict[str, object], rid: str, model_file: str) -> None:
    assert result["id"] == rid
    assert result["option_ids"] == ["billing", "shipping", "access"]
    probabilities = result["probabilities"]
    assert isinstance(probabilities, list) and len(probabilities) == 3
    assert abs(sum(probabilities) - 1.0) < 1e-6
    assert result["choice"] in result["option_ids"]  # type: ignore[operator]
    assert result["model"]["file"] == model_file  # type: ignore[index]


@pytest.fixture(scope="module")
def served(image: str, packaged_model: Path) -> Iterator[Container]:
    """One `IMAGE serve` as SageMaker starts it (8080 published on a free host port), shared by the
    tests below that only send requests to it."""
    from tests.container.podman_support import LIMITS

    name = f"arbiter-ct-served-{free_port()}"
    port = free_port()
    started = time.monotonic()
    podman(
        "run", "--detach", "--name", name, *LIMITS,
        *published(port), *model_at_opt_ml_model(packaged_model), image, "serve",
    )  # fmt: skip
    container = Container(name=name, started=started, port=port)
    try:
        took = container.wait_ping()
        record("time from `podman run` to the first /ping 200", round(took, 2), "s")
        yield container
    finally:
        podman("rm", "--force", "--time", "0", name, check=False)


def test_ping_answers_200_on_8080_within_the_stated_time(served: Container):
    """The fixture's wait_ping failed the module unless the first 200 came within PING_WITHIN_S
    of `podman run` (SageMaker allows 240 s by default); the published port is 8080's."""
    status, body, _ = http("GET", f"{served.url}/ping")
    assert status == 200, body
    [listening] = [e for e in served.events() if e.get("event") == "listening"]
    assert listening["port"] == 8080
    assert listening["host"] == "0.0.0.0"  # the image's own setting (serve's default is loopback)


def test_the_model_is_the_one_mounted_at_opt_ml_model(served: Container):
    report = served.preflight()
    assert report["model"] == f"/opt/ml/model/{SMOL}"
    assert report["model_source"] == "model_dir" and report["manifest"] is True
    assert report["n_gpu_layers"] == 0


def test_invocations_single(served: Container):
    body = json.dumps({"decision": decision(1)}).encode()
    status, raw, headers = http("POST", f"{served.url}/invocations", body)
    assert status == 200, raw
    assert headers["Content-Type"].startswith("application/json")
    assert_result(json.loads(raw)["result"], "d1", SMOL)
    timings = []
    for _ in range(5):
        began = time.monotonic()
        status, raw, _ = http("POST", f"{served.url}/invocations", body)
        timings.append(time.monotonic() - began)
        assert status == 200, raw
    record("one decision over HTTP (median of 5, after one warm-up)",
           round(statistics.median(timings), 3), "s")  # fmt: skip


def test_invocations_several(served: Container):
    body = json.dumps({"decisions": [decision(i) for i in range(4)]}).encode()
    status, raw, _ = http("POST", f"{served.url}/invocations", body)
    assert status == 200, raw
    results = json.loads(raw)["results"]
    assert [r["id"] for r in results] == ["d0", "d1", "d2", "d3"]
    for i, result in enumerate(results):
        assert_result(result, f"d{i}", SMOL)


def test_invocations_json_lines(served: Container):
    lines = [json.dumps(decision(i)) for i in range(3)] + ["{not json"]
    body = ("\n".join(lines) + "\n").encode()
    status, raw, headers = http("POST", f"{served.url}/invocations", body, "application/jsonlines")
    assert status == 200, raw
    assert headers["Content-Type"].startswith("application/jsonlines")
    records = [json.loads(line) for line in raw.decode().splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 4]
    for i, rec in enumerate(records[:3]):
        assert_result(rec["result"], f"d{i}", SMOL)
    assert "error" in records[3] and "result" not in records[3]


def test_execution_parameters(served: Container):
    status, raw, _ = http("GET", f"{served.url}/execution-parameters")
    assert status == 200, raw
    params = json.loads(raw)
    assert params["BatchStrategy"] == "MULTI_RECORD"
    assert params["MaxConcurrentTransforms"] >= 1 and params["MaxPayloadInMB"] >= 1


def test_the_server_is_pid_1_and_not_root(served: Container):
    """The entrypoint exec'd `arbiter serve`: PID 1 is the server (it receives SIGTERM) and runs as
    the image's user."""
    status = served.exec("cat", "/proc/1/status")
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert set(uids) == {str(IMAGE_UID)}
    cmdline = served.exec("cat", "/proc/1/cmdline").split("\0")
    assert cmdline[1:4] == ["-m", "arbiter", "serve"]


def test_sagemaker_bind_to_port_is_honoured(run_container: RunContainer, packaged_model: Path):
    port = free_port()
    container = run_container(*bound_to(port), *model_at_opt_ml_model(packaged_model), port=port)
    container.wait_ping()
    [listening] = [e for e in container.events() if e.get("event") == "listening"]
    assert listening["port"] == port


def test_a_manifest_mismatch_exits_non_zero_with_one_line_and_never_listens(
    run_container: RunContainer, tampered_model: Path
):
    port = free_port()
    container = run_container(*bound_to(port), *model_at_opt_ml_model(tampered_model), port=port)
    answered = 0
    deadline = time.monotonic() + 120
    while container.running() and time.monotonic() < deadline:
        try:
            http("GET", f"{container.url}/ping")
            answered += 1
        except OSError:
            pass
        time.sleep(0.05)
    code = container.wait_exit()
    assert code != 0
    assert answered == 0, "something listened on the port"
    lines = [line for line in container.logs().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("arbiter entrypoint: refusing to start `serve`: ")
    assert "manifest expects " + "0" * 64 in lines[0]


def test_read_only_root_filesystem_with_a_tmpfs_tmp(run_container: RunContainer):
    """No model mounted: the image's own default, assembled at build time, is served; nothing
    needs the root filesystem to be writable."""
    port = free_port()
    container = run_container(
        "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp", *published(port), port=port
    )
    took = container.wait_ping()
    record("time to the first /ping 200, read-only root, default model", round(took, 2), "s")
    status, raw, _ = http(
        "POST", f"{container.url}/invocations", json.dumps({"decision": decision(7)}).encode()
    )
    assert status == 200, raw
    assert_result(json.loads(raw)["result"], "d7", DEFAULT)
    report = container.preflight()
    assert (
        report["model"] == f"/opt/arbiter/model/{DEFAULT}" and report["model_source"] == "bundled"
    )
    assert "Traceback" not in container.logs()


def test_sigterm_stops_serve_with_status_0_within_the_grace_time(
    run_container: RunContainer, packaged_model: Path
):
    port = free_port()
    container = run_container(*published(port), *model_at_opt_ml_model(packaged_model), port=port)
    container.wait_ping()
    code, took = container.stop()
    record("`podman stop` (SIGTERM) of serve until exit", round(took, 2), "s")
    assert code == 0, container.logs()
    assert took < STOP_GRACE_S  # SIGKILL would have come at STOP_GRACE_S, with status 137
