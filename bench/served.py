"""A local `arbiter serve` for the benchmarks that measure the server itself (abuse, soak).

The server runs as its own process, started as a user would start it (``python -m arbiter serve``,
loopback, default settings unless the benchmark names one), its log kept in a file; its RSS and
open file descriptors are read from ``/proc``; its gauges from ``/metrics``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.common import free_port, stop, wait_until_ready


@dataclass(frozen=True)
class Served:
    base: str
    pid: int
    log: Path

    def rss_mb(self) -> float:
        """Resident memory now, from /proc/<pid>/status (VmRSS, kB)."""
        status = Path(f"/proc/{self.pid}/status").read_text()
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        return int(match.group(1)) / 1024 if match else float("nan")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def log_events(self) -> list[dict[str, object]]:
        """The server's JSON log lines so far."""
        events = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue
        return events


def metric(text: str, name: str, **labels: str) -> float | None:
    """One sample of Prometheus text (labels matched exactly, in any order); None if absent."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if "{" in head:
            metric_name, _, rest = head.partition("{")
            found = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        else:
            metric_name, found = head, {}
        if metric_name == name and found == labels:
            return float(value)
    return None


@contextmanager
def served(env: Mapping[str, str] | None = None, model: Path | None = None) -> Iterator[Served]:
    """`arbiter serve` on a free loopback port until the block ends (JSON logs, in a file)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # The caller's settings are left out; where its models are stored is not a setting.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ARBITER_", "SM_"))}
    if "ARBITER_MODEL_STORE" in os.environ:
        clean["ARBITER_MODEL_STORE"] = os.environ["ARBITER_MODEL_STORE"]
    full_env = {**clean, "ARBITER_PORT": str(port), "ARBITER_LOG_JSON": "true", **(env or {})}
    command = [sys.executable, "-m", "arbiter", "serve"]
    if model is not None:
        command += ["--model", str(model)]
    with tempfile.TemporaryDirectory(prefix="arbiter-served-") as tmp:
        log = Path(tmp) / "serve.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(command, env=full_env, stdout=sink, stderr=sink)
        try:
            wait_until_ready(proc, f"{base}/ping", "arbiter serve", log, 300, 0.2)
            yield Served(base, proc.pid, log)
        finally:
            stop(proc)
