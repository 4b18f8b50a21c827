"""Streamed responses: once the status line is sent, an error can only be written in-band.

A handler that streams (JSON Lines, server-sent events) registers its response as the request's
``OPEN_STREAM`` with the way it writes an error record. If anything escapes the handler after the
response was prepared, the error middleware ends the stream with that record instead of writing a
second status line into the chunked body (which is what a fresh error response would do).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from arbiter.errors import ArbiterError


@dataclass
class OpenStream:
    response: web.StreamResponse
    error_record: Callable[[ArbiterError], bytes]
    closed: bool = False

    async def fail(self, error: ArbiterError) -> None:
        """Write the error record and end the stream; a client that left is not an error."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.response.write(self.error_record(error))
            await self.response.write_eof()

    async def finish(self) -> None:
        self.closed = True
        await self.response.write_eof()


OPEN_STREAM = web.RequestKey("open_stream", OpenStream)
