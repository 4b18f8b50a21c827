"""The container side: what SageMaker sends to ``POST /invocations`` and what it passes back.

SageMaker strips every request header but the ones its API names and maps them onto the container's
request (``InvokeEndpoint``'s ``Content-Type`` and ``Accept``; the async and streaming operations'
``X-Amzn-SageMaker-Content-Type`` / ``-Accept``), passes ``X-Amzn-SageMaker-Custom-Attributes`` and
``-Inference-Id`` through, and on the way back keeps only the content type and the custom
attributes the container set. What the caller did not send is not invented: aiohttp's own
``Accept: */*``, ``Accept-Encoding`` and ``User-Agent`` are left off (a container that negotiates
on ``Accept`` would read ``*/*`` as the caller's choice).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
INFERENCE_ID = "X-Amzn-SageMaker-Inference-Id"
INVENTED = ("Accept", "Accept-Encoding", "User-Agent")  # aiohttp's own; a caller's Accept is sent


class ContainerUnreachable(Exception):
    """No connection to the container (not started, crashed)."""


class ResponseTooLarge(Exception):
    """The container's answer is over what the operation returns."""

    def __init__(self, most_bytes: int) -> None:
        super().__init__(f"the model's response is larger than {most_bytes} bytes")
        self.most_bytes = most_bytes


@dataclass(frozen=True)
class Invocation:
    """One request to the container, as SageMaker would send it."""

    body: Any  # bytes, or an async iterator of bytes (an async payload streamed from S3)
    content_type: str | None = None
    accept: str | None = None
    custom_attributes: str | None = None
    inference_id: str | None = None

    def headers(self) -> dict[str, str]:
        named = {
            "Content-Type": self.content_type,
            "Accept": self.accept,
            CUSTOM_ATTRIBUTES: self.custom_attributes,
            INFERENCE_ID: self.inference_id,
        }
        return {k: v for k, v in named.items() if v is not None}


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str | None
    custom_attributes: str | None
    body: bytes


def passed_back(response: aiohttp.ClientResponse) -> tuple[str | None, str | None]:
    """(content type, custom attributes) of a container response: all SageMaker keeps."""
    return response.headers.get("Content-Type"), response.headers.get(CUSTOM_ATTRIBUTES)


class Container:
    """``POST {url}/invocations`` over one connection pool."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url.rstrip("/") + "/invocations"
        self.session = session

    @asynccontextmanager
    async def open(
        self, invocation: Invocation, timeout_s: float
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The container's response with its headers read; the body is the caller's to read within
        the same ``timeout_s`` (``asyncio.TimeoutError`` past it)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        # SageMaker passes the caller's headers, and invents none (aiohttp would add Accept,
        # Accept-Encoding, User-Agent, and application/octet-stream to a body without a type).
        skip = INVENTED if invocation.content_type is not None else (*INVENTED, "Content-Type")
        try:
            async with self.session.post(
                self.url,
                data=invocation.body,
                headers=invocation.headers(),
                timeout=timeout,
                skip_auto_headers=skip,
            ) as response:
                yield response
        except aiohttp.ClientConnectorError as exc:
            raise ContainerUnreachable(f"cannot connect to the container at {self.url}") from exc

    async def invoke(self, invocation: Invocation, timeout_s: float, most_bytes: int) -> Reply:
        """The whole response (``asyncio.TimeoutError`` when it takes over ``timeout_s``); a body
        over ``most_bytes`` is :class:`ResponseTooLarge`, found without holding more than that."""
        async with asyncio.timeout(timeout_s), self.open(invocation, timeout_s) as response:
            body = bytearray()
            async for chunk in response.content.iter_any():
                body += chunk
                if len(body) > most_bytes:
                    raise ResponseTooLarge(most_bytes)
            content_type, attributes = passed_back(response)
            return Reply(response.status, content_type, attributes, bytes(body))
