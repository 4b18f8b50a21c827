"""`arbiter local`'s output when its terminal goes (a closed window, a dropped SSH session).

The shell sends each of its jobs SIGHUP, which stops the stack like Ctrl-C (``STOP_SIGNALS``); but
every write to the hung-up terminal then fails (EIO; a closed pipe: EPIPE), and a stop that died on
its own "stopping" line left its parts killed and its state unsaved. So the stack's own lines go
through :class:`Outliving`: the first write that fails sends that stream, and every later line, to
/dev/null, and the stop carries on. The parts' logs already drop a line they cannot write
(:mod:`arbiter.logging`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO


class Outliving:
    """``stream``, but a write or flush that fails points it at /dev/null instead of raising."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.lost = False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            self._lose()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self._lose()

    def _lose(self) -> None:
        """Its descriptor now names /dev/null: what is buffered, and the flush at exit, go there."""
        self.lost = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def outliving_terminal() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` as :class:`Outliving` streams meanwhile."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Outliving(sys.stdout), Outliving(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
