"""`arbiter local` as a process under test: started with the tests' environment, its output read
line by line, stopped by a signal as a user's Ctrl-C would, or by its terminal closing."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests import ROOT
from tests.environ import environ_without


def local_env(**extra: Any) -> dict[str, str]:
    """The tests' environment less every ARBITER_*/AWS_* setting, with a fake worker engine."""
    env = environ_without("ARBITER_", "AWS_", "PROMETHEUS_")
    env.update(
        PYTHONPATH=str(ROOT),
        ARBITER_WAIT_TIME_S="1",
        ARBITER_WORKER_ENGINE_FACTORY="tests.fakes:make_fake_engine",
        ARBITER_N_THREADS="1",
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Local:
    """`arbiter local ARGS` with ``env``; ``lines`` fills as it prints (stdout and stderr). The
    checkout's by default, or ``arbiter`` (a path: the built wheel's) run in ``cwd``. It leads a
    process group of its own with its parts, as a shell's job does; with ``terminal`` its output
    goes to a pseudo-terminal, which :meth:`hang_up` closes as a closed window or SSH session does."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        arbiter: Path | None = None,
        cwd: Path = ROOT,
        terminal: bool = False,
    ) -> None:
        program = [str(arbiter)] if arbiter else [sys.executable, "-m", "arbiter"]
        self._master: int | None = None
        output: int = subprocess.PIPE
        if terminal:
            self._master, output = os.openpty()
        self.popen = subprocess.Popen(
            [*program, "local", *args],
            env=env,
            cwd=cwd,
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0,
        )
        self.lines: list[str] = []
        self._reading = True
        if self._master is not None:
            os.close(output)
            self._reader = threading.Thread(target=self._read_terminal, daemon=True)
        else:
            out = self.popen.stdout
            assert out is not None
            self._reader = threading.Thread(
                target=lambda: self.lines.extend(iter(out.readline, "")), daemon=True
            )
        self._reader.start()

    def _read_terminal(self) -> None:
        assert self._master is not None
        pending = b""
        while self._reading:
            if not select.select([self._master], [], [], 0.1)[0]:
                continue
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # EIO: every writer is gone
                chunk = b""
            if not chunk:
                break
            pending += chunk
            *complete, pending = pending.split(b"\n")
            self.lines.extend(line.decode(errors="replace") + "\n" for line in complete)

    def hang_up(self) -> None:
        """Close the terminal, then SIGHUP the job's process group, as the shell does when its
        terminal goes."""
        assert self._master is not None
        self._reading = False
        self._reader.join(timeout=10)
        os.close(self._master)
        self._master = None
        os.killpg(self.popen.pid, signal.SIGHUP)

    def signal_group(self, sig: int) -> None:
        """``sig`` to the stack and its parts, as a terminal's Ctrl-C reaches a whole job."""
        os.killpg(self.popen.pid, sig)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, found: Callable[[str], bool], within_s: float = 120) -> str:
        """The first line ``found`` accepts; fails with the output if none comes in time."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if found(line):
                    return line
            if self.popen.poll() is not None and not self._reader.is_alive():
                said = f"exited with status {self.popen.returncode} before printing it"
                break
            time.sleep(0.1)
        else:
            said = f"not printed within {within_s} s"
        raise AssertionError(f"{said}:\n{self.text()}")

    def close(self, timeout_s: float = 60) -> int:
        if self.popen.poll() is None:
            self.popen.terminate()
        try:
            code = self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            code = self.popen.wait()
        self._reading = False
        self._reader.join(timeout=10)
        if self._master is not None:
            os.close(self._master)
            self._master = None
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        return code
