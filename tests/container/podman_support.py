"""Running the image under test with podman (``scripts/podman``: private storage, runc) and
talking to it over the host's loopback."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PODMAN = str(ROOT / "scripts" / "podman")
# These VMs' default open-files limit is above the hard cap; SageMaker and ECS set their own.
LIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096"]
IMAGE_UID = 10001
# SageMaker: a container that does not answer /ping with 200 within 4 minutes of its start fails
# the endpoint; SIGKILL follows SIGTERM after 30 s (ECS's default stopTimeout is 30 s too).
PING_WITHIN_S = 60.0
STOP_GRACE_S = 30


def podman(
    *args: str, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=check
    )


def record(what: str, value: float | str, unit: str = "") -> None:
    """A figure for the summary `make test-container` prints (not an assertion)."""
    path = os.environ.get("ARBITER_CONTAINER_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"what": what, "value": value, "unit": unit}) + "\n")


def http(
    method: str, url: str, body: bytes | None = None, content_type: str = "application/json"
) -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


@dataclass
class Container:
    name: str
    started: float  # time.monotonic() when `podman run` was called
    port: int | None = None  # the host port its server answers on
    stopped_in_s: float | None = field(default=None)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        out = podman("logs", self.name, check=False)
        return out.stdout + out.stderr

    def state(self) -> dict[str, Any]:
        """``podman inspect``'s State. Asked again a few times: an inspect that races the
        container's own exit was seen to fail (status 125) once, the container still there."""
        for _ in range(5):
            out = podman("inspect", "--format", "{{json .State}}", self.name, check=False)
            if out.returncode == 0:
                state: dict[str, Any] = json.loads(out.stdout)
                return state
            time.sleep(0.2)
        raise AssertionError(f"podman inspect {self.name}: status {out.returncode}: {out.stderr}")

    def running(self) -> bool:
        return bool(self.state().get("Running"))

    def exec(self, *argv: str) -> str:
        return podman("exec", self.name, *argv).stdout

    def wait_exit(self, timeout: float = 120) -> int:
        out = podman("wait", self.name, timeout=timeout)
        return int(out.stdout.strip().splitlines()[-1])

    def wait_ping(self, within_s: float = PING_WITHIN_S) -> float:
        """Seconds from `podman run` to the first /ping 200; fails with the logs otherwise."""
        deadline = self.started + within_s
        while time.monotonic() < deadline:
            try:
                status, _, _ = http("GET", f"{self.url}/ping")
                if status == 200:
                    return time.monotonic() - self.started
            except OSError:
                pass
            if not self.running():
                pytest.fail(f"{self.name} exited before /ping answered:\n{self.logs()}")
            time.sleep(0.1)
        pytest.fail(f"/ping did not answer 200 within {within_s} s:\n{self.logs()}")

    def wait_log(self, text: str, within_s: float = 120) -> str:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            logs = self.logs()
            if text in logs:
                return logs
            if not self.running():
                pytest.fail(f"{self.name} exited before logging {text!r}:\n{logs}")
            time.sleep(0.2)
        pytest.fail(f"{self.name} did not log {text!r} within {within_s} s:\n{self.logs()}")

    def stop(self) -> tuple[int, float]:
        """SIGTERM, SIGKILL after the grace time (`podman stop -t 30`, as ECS and SageMaker do);
        returns the exit status and the seconds it took."""
        began = time.monotonic()
        podman("stop", "--time", str(STOP_GRACE_S), self.name, timeout=STOP_GRACE_S + 60)
        took = time.monotonic() - began
        self.stopped_in_s = took
        return int(self.state()["ExitCode"]), took

    def events(self) -> list[dict[str, Any]]:
        """The JSON log lines (structlog's and the entrypoint's), in order."""
        found = []
        for line in self.logs().splitlines():
            if line.startswith("{"):
                try:
                    found.append(json.loads(line))
                except ValueError:
                    continue
        return found

    def preflight(self) -> dict[str, Any]:
        """The entrypoint's one JSON report line."""
        for line in self.logs().splitlines():
            if '"entrypoint_preflight"' in line:
                report: dict[str, Any] = json.loads(line)
                return report
        pytest.fail(f"no entrypoint report in the logs:\n{self.logs()}")


RunContainer = Callable[..., Container]
