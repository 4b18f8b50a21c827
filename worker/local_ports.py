"""Where `arbiter local`'s parts listen: one base port, the others beside it.

``ARBITER_PORT`` (``--port``) is the container's port and the stack's base: the SageMaker runtime
API listens on base + 1, the S3 + SQS server (moto) on base + 2 and the worker pool's metrics on
base + 3, and the runtime calls the container this stack started. So a second stack moved with one
variable shares nothing with the first, neither the container its runtime calls nor its pool's
metrics port. A component's own variable (``ARBITER_RUNTIME_PORT``, ``ARBITER_METRICS_PORT``,
``ARBITER_LOCAL_MOTO_PORT``) still wins; base 0 gives each part a free port of its own.

Every port is claimed before anything starts: bound, listening and held by `arbiter local` until
its part takes the socket over (:func:`arbiter.ports.bind` adopts it; moto serves on it in
process). So a busy one is refused in one line before a model loads, naming the part and the
variable that moves it, and a second stack started a moment after the first is refused the same
way, never left waiting on a port the first took between its check and its bind.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from arbiter.errors import ArbiterError
from arbiter.ports import bind, spare_port, why

OFFSETS = {"container": 0, "runtime": 1, "s3": 2, "metrics": 3}


class LocalSettings(BaseSettings):
    """`arbiter local`'s own settings (``ARBITER_LOCAL_*``), and the ports of the parts it starts."""

    model_config = SettingsConfigDict(
        env_prefix="ARBITER_LOCAL_", extra="ignore", populate_by_name=True
    )

    port: int = Field(
        default=8080,
        ge=0,
        le=65_532,
        validation_alias=AliasChoices("ARBITER_PORT"),
        description="The container's port and the stack's base: runtime API +1, S3/SQS +2, "
        "worker metrics +3 (0: a free port each).",
    )
    host: str = Field(
        default="127.0.0.1",
        validation_alias=AliasChoices("ARBITER_HOST"),
        description="The container's interface; the other parts listen on 127.0.0.1.",
    )
    runtime_port: int | None = Field(
        default=None,
        ge=0,
        le=65_535,
        validation_alias=AliasChoices("ARBITER_RUNTIME_PORT"),
        description="The SageMaker runtime API's port (default: base + 1).",
    )
    moto_port: int | None = Field(
        default=None,
        ge=0,
        le=65_535,
        description="The local S3 + SQS server's port (default: base + 2).",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65_535,
        validation_alias=AliasChoices("ARBITER_METRICS_PORT"),
        description="The worker pool's /metrics port (default: base + 3).",
    )
    container_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("ARBITER_RUNTIME_CONTAINER_URL"),
        description="The container the runtime calls (default: the one this stack starts).",
    )
    state_dir: str | None = Field(
        default=None,
        description="Where the local S3 + SQS state is kept between runs (default "
        "$XDG_STATE_HOME/arbiter/local, else ~/.local/state/arbiter/local; empty: not kept).",
    )
    drain_s: float = Field(
        default=2.0,
        ge=0,
        description="At Ctrl-C or SIGTERM, the time each part has to finish what it holds before "
        "it hands it back (unless ARBITER_DRAIN_DEADLINE_S / ARBITER_RUNTIME_DRAIN_S say).",
    )

    def state_path(self, s3_port: int) -> Path | None:
        """The state file of the S3 + SQS server on ``s3_port`` (None: not kept, or the port was
        picked free for this run: no later run finds the same one)."""
        asked = self.moto_port if self.moto_port is not None else self.port and self.port + 2
        if self.state_dir == "" or asked == 0:
            return None
        if self.state_dir is not None:
            folder = Path(self.state_dir).expanduser()
        else:
            base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
            folder = Path(base) / "arbiter" / "local"
        return folder / f"s3-sqs-{s3_port}.moto"


@dataclass(frozen=True)
class Part:
    name: str  # what the user reads: "the container (arbiter serve)"
    variable: str  # what moves it
    host: str
    port: int  # 0 until chosen
    sock: socket.socket | None = field(default=None, compare=False, repr=False)  # claimed


@dataclass(frozen=True)
class Ports:
    """The parts' ports, each held (listening) until its part takes it or :meth:`close`."""

    container: Part | None
    runtime: Part | None
    s3: Part | None
    metrics: Part | None

    def parts(self) -> list[Part]:
        return [p for p in (self.container, self.runtime, self.s3, self.metrics) if p is not None]

    def close(self) -> None:
        for part in self.parts():
            if part.sock is not None:
                part.sock.close()

    def __enter__(self) -> Ports:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def plan(settings: LocalSettings, *, serve: bool, runtime: bool, work: bool, moto: bool) -> Ports:
    """The ports of the parts that will start, each claimed (or chosen, for 0) now and held."""
    base = settings.port

    def derived(name: str, own: int | None) -> int:
        if own is not None:
            return own
        return 0 if base == 0 else base + OFFSETS[name]

    loopback = "127.0.0.1"
    wanted = {
        "container": Part(
            "the container (arbiter serve)",
            "ARBITER_PORT",
            settings.host,
            derived("container", None),
        )
        if serve
        else None,
        "runtime": Part(
            "the SageMaker runtime API (arbiter runtime)",
            "ARBITER_RUNTIME_PORT",
            loopback,
            derived("runtime", settings.runtime_port),
        )
        if runtime
        else None,
        "s3": Part(
            "the S3 + SQS server (moto)",
            "ARBITER_LOCAL_MOTO_PORT",
            loopback,
            derived("s3", settings.moto_port),
        )
        if moto
        else None,
        "metrics": Part(
            "the worker pool's metrics",
            "ARBITER_METRICS_PORT",
            loopback,
            derived("metrics", settings.metrics_port),
        )
        if work and settings.metrics_port != 0
        else None,
    }
    taken: set[int] = set()
    chosen: dict[str, Part | None] = dict.fromkeys(wanted)
    try:
        for key, part in wanted.items():
            if part is not None:
                sock = _claim(part, taken, base)
                port = int(sock.getsockname()[1])
                taken.add(port)
                chosen[key] = Part(part.name, part.variable, part.host, port, sock)
    except BaseException:
        Ports(**chosen).close()
        raise
    return Ports(**chosen)


def _claim(part: Part, taken: set[int], base: int) -> socket.socket:
    """``part``'s port bound and listening (a free one for 0); refused in one line if not."""
    hint = (
        f"set ARBITER_PORT to move the whole stack (now {base}: container {base}, runtime API "
        f"{base + 1}, S3/SQS {base + 2}, worker metrics {base + 3})"
        if base
        else f"set {part.variable}"
    )
    if part.port in taken:
        raise ArbiterError(f"refused: {part.name} would share port {part.port}; {hint}")
    port = part.port or spare_port(part.host, taken)  # 0: one no connection takes meanwhile
    try:
        sock = bind(part.host, port, part.name, part.variable)
    except ArbiterError as exc:
        raise ArbiterError(
            f"refused: port {part.port} on {part.host} for {part.name} is {why(exc.__cause__)} "
            "(another stack?); "
            f"{hint}"
        ) from exc
    return sock
