"""Starting a peer server on loopback for a benchmark: a free port, and waiting until it answers."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_ready(
    proc: subprocess.Popen[bytes], url: str, name: str, log: Path, timeout_s: float, poll_s: float
) -> None:
    """Poll ``url`` until it answers; raise (naming ``log``) if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start; see {log}") from None
            time.sleep(poll_s)
