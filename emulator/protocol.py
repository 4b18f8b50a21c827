"""The front's HTTP connections, where aiohttp's server does not bound or word things as AWS would.

- **Request headers are timed.** A client that sends its headers slowly held a connection for as
  long as aiohttp's keep-alive allowed (75 s, renewed by each request); now headers begun must be
  complete within ``header_timeout_s`` (``ARBITER_RUNTIME_BODY_TIMEOUT_S``, as for bodies), or
  the connection gets 408 ``RequestTimeout`` and is closed.
- **A request aiohttp cannot parse is a ValidationError.** Headers over aiohttp's 8 KB limit (or
  a broken request line) got its plain-text 400, which botocore reads as a bare ``400``; the
  answer now has SageMaker's error shape (``x-amzn-ErrorType``), so boto3 raises ValidationError.
- **What the client has not taken** (:func:`unsent`): bytes still in the connection's buffers,
  for the response stream's idle check (``emulator.realtime``).
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from emulator.errors import RequestTimeout, RuntimeApiError, ValidationError


def _raw(error: RuntimeApiError) -> bytes:
    """``error`` as bytes on the wire, for a connection with no request object to answer."""
    response = error.response()
    body = bytes(response.body) if isinstance(response.body, bytes) else b""
    head = [f"HTTP/1.1 {response.status} {response.reason}"]
    head += [f"{k}: {v}" for k, v in response.headers.items() if k.lower() != "content-length"]
    head += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(head).encode() + body


class FrontHandler(RequestHandler):
    """aiohttp's request handler, with the header timeout and SageMaker-shaped parse errors."""

    header_timeout_s = 10.0
    _timer: asyncio.TimerHandle | None = None
    _between_requests = False  # set after a response: the next bytes begin new headers

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if data and self._between_requests:
            self._between_requests = False
            self._arm()
        super().data_received(data)
        if self._messages:  # a request's headers are complete
            self._disarm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def next_request(self) -> None:
        """Called once a request was answered: the headers of the next one are timed."""
        self._between_requests = True

    def _arm(self) -> None:
        self._disarm()
        self._timer = self._loop.call_later(self.header_timeout_s, self._late)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self) -> None:
        self._timer = None
        if self.transport is None or self._messages:
            return
        error = RequestTimeout(
            f"The request's headers were not received within {self.header_timeout_s:g} s."
        )
        self.transport.write(_raw(error))
        self.force_close()
        self.transport.close()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status != 400:
            return super().handle_error(request, status, exc, message)
        # The parser's own message quotes the offending bytes (a CustomAttributes value, which
        # AWS shows as ***): only its kind is said.
        kind = type(exc).__name__ if exc is not None else "BadRequest"
        response = ValidationError(
            f"The request could not be read ({kind}): a request line or header is limited to "
            f"{self.max_field_size:,} bytes."
        ).response()
        response.force_close()  # as aiohttp's own: a connection it cannot parse is not reused
        return response


class FrontServer(web.Server):
    """aiohttp's server with :class:`FrontHandler` connections."""

    header_timeout_s = 10.0

    def __call__(self) -> RequestHandler:
        handler = FrontHandler(self, loop=self._loop, **self._kwargs)
        handler.header_timeout_s = self.header_timeout_s
        return handler


class FrontRunner(web.AppRunner):
    def __init__(self, app: web.Application, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.header_timeout_s = header_timeout_s

    async def _make_server(self) -> web.Server:
        # The application builds its own web.Server (Application._make_handler): it becomes a
        # FrontServer in place, the one seam aiohttp leaves for the connections' handler class.
        server = await super()._make_server()
        server.__class__ = FrontServer
        server.header_timeout_s = self.header_timeout_s  # type: ignore[attr-defined]
        return server


def unsent(transport: asyncio.BaseTransport | None) -> int | None:
    """Bytes written to ``transport`` that the client's side has not taken yet: its buffer, and
    the socket's send queue (Linux's ``SIOCOUTQ``); None where that cannot be told."""
    if transport is None or transport.is_closing():
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(termios, "TIOCOUTQ"):
        return None
    try:
        queued = struct.unpack("I", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except OSError:
        return None
    buffered = (
        transport.get_write_buffer_size() if hasattr(transport, "get_write_buffer_size") else 0
    )
    return int(queued) + int(buffered)
