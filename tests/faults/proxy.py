"""A loopback proxy in front of an S3/SQS endpoint that injects what real S3 and SQS do at scale,
in the real AWS client's path (aiobotocore, botocore's retries, signing and parsing all run).

Each worker gets a port of its own (:meth:`FaultProxy.endpoint`), so the proxy knows whose request it
holds. For every request a plan (``decide``) picks an :class:`Action`:

- ``lose_response``: forward the request (S3 or SQS commits it), then drop the connection before the
  answer: botocore sees a reset and sends the same request again (a committed write whose 200 was
  lost: S3 documents a 500 after a commit, and read timeouts do the same);
- ``fail_503`` / ``fail_500``: answer ``SlowDown`` (S3) or ``InternalError`` without forwarding;
- ``conflict_409``: answer an S3 write 409 ``ConditionalRequestConflict`` without forwarding (S3's
  answer to a conditional write while another conditional write to the key is in flight; moto's
  lock makes it impossible there);
- ``fake_delete``: answer an SQS ``DeleteMessage``/``DeleteMessageBatch`` with success without
  forwarding, so the message comes back after its visibility timeout;
- ``duplicate``: forward an SQS ``SendMessage``/``SendMessageBatch`` twice (a duplicate delivery);
- ``redeliver``: answer a ``ReceiveMessage`` with the message another worker received last, still
  in its hands (SQS's at-least-once: the same message, in flight, delivered to a second consumer),
  as SQS delivers it: with a receipt handle of its own (the proxy maps it back to the real one on
  the way to the endpoint) and ``ApproximateReceiveCount`` one higher;
- ``delay``: forward after a pause (a slow request, so a race can be set up);
- ``kill_before`` / ``kill_after`` / ``kill_during``: the worker dies before this request reaches
  the endpoint, just after the endpoint committed it, or inside it (half of the answer's body
  sent: a read cut off mid-stream); from then on every request of that worker is dropped unsent
  (``on_kill`` is told, to cancel the worker's tasks), so no ``finally`` of a dead worker can touch
  the world;
- ``forbid_missing`` turns a 404 on GET/HEAD of an object into the 403 ``AccessDenied`` that S3
  answers a role without ``s3:ListBucket``; ``missing`` answers a GET/HEAD ``NoSuchKey`` without
  forwarding (an object deleted behind the worker's back, as this worker sees it); ``deny`` answers
  403 ``AccessDenied`` without forwarding (a role without the grant: with ``Call.version``, what
  AWS answers a ``?versionId=`` read by a role without ``s3:GetObjectVersion``; on one object,
  one encrypted with a KMS key the role may not use); ``kms_disabled`` answers 400
  ``KMS.DisabledException`` (an object encrypted with a KMS key that was disabled).

The proxy also reads SQS ``ReceiveMessage`` answers, so a plan knows which message (and which receive
of it) a worker is handling when it decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from aiohttp import ClientSession, ClientTimeout, web

HOP = {
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "expect",
    "te",
    "upgrade",
}
ACTIONS = (
    "forward",
    "lose_response",
    "fail_503",
    "fail_500",
    "conflict_409",
    "fake_delete",
    "duplicate",
    "kill_before",
    "kill_after",
    "kill_during",
    "forbid_missing",
    "deny",
    "kms_disabled",
    "missing",
    "delay",
    "redeliver",
)
SQS_WRITES = {
    "SendMessage",
    "SendMessageBatch",
    "DeleteMessage",
    "DeleteMessageBatch",
    "ChangeMessageVisibility",
    "ChangeMessageVisibilityBatch",
    "PurgeQueue",
}


@dataclass(frozen=True)
class Held:
    """The message a worker received last: its body, which receive of it this is, the receipt
    handle of this receive (each receive has its own), and the message's ID."""

    body: str
    receive_count: int
    receipt: str = ""
    message_id: str = ""


@dataclass(frozen=True)
class Call:
    """One request as the plan sees it."""

    worker: int
    service: str  # "s3" | "sqs"
    op: str  # PutObject, CompleteMultipartUpload, SendMessage, ...
    key: str  # the S3 key, or the SQS queue URL's path
    number: int  # this worker's n-th request (from 1)
    held: Held | None  # the message this worker handles now
    conditional: bool = False  # an S3 write with If-None-Match or If-Match
    version: bool = False  # an S3 request that names an object version (``?versionId=``)

    @property
    def write(self) -> bool:
        if self.service == "sqs":
            return self.op in SQS_WRITES
        return self.op not in S3_READS


S3_READS = {
    "GetObject",
    "HeadObject",
    "ListObjectsV2",
    "ListObjects",
    "ListMultipartUploads",
    "ListObjectVersions",
    "ListParts",
    "HeadBucket",
    "GetBucket",
}


def s3_op(method: str, path: str, query: dict[str, list[str]], headers: Any) -> tuple[str, str]:
    """The S3 operation of a path-style request, and its key ('' for a bucket operation)."""
    parts = path.lstrip("/").split("/", 1)
    key = parts[1] if len(parts) > 1 else ""
    if method in ("GET", "HEAD"):
        return _s3_read(method, key, query), key
    return _s3_write(method, key, query, headers), key


def _s3_read(method: str, key: str, query: dict[str, list[str]]) -> str:
    if key:
        if method == "HEAD":
            return "HeadObject"
        return "ListParts" if "uploadId" in query else "GetObject"
    for name, op in (
        ("list-type", "ListObjectsV2"),
        ("uploads", "ListMultipartUploads"),
        ("versions", "ListObjectVersions"),
    ):
        if name in query:
            return op
    return "HeadBucket" if method == "HEAD" else "GetBucket"


def _s3_write(method: str, key: str, query: dict[str, list[str]], headers: Any) -> str:
    copy = "x-amz-copy-source" in headers
    if method == "PUT":
        if "partNumber" in query:
            return "UploadPartCopy" if copy else "UploadPart"
        return ("CopyObject" if copy else "PutObject") if key else "PutBucket"
    if method == "POST":
        for name, op in (
            ("uploads", "CreateMultipartUpload"),
            ("uploadId", "CompleteMultipartUpload"),
            ("delete", "DeleteObjects"),
        ):
            if name in query:
                return op
        return "PostObject"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    return method


@dataclass
class _Worker:
    number: int = 0
    held: Held | None = None
    received: bytes | None = None  # the last ReceiveMessage answer that held a message
    dead: bool = False


Decide = Callable[[Call], str]


@dataclass
class FaultProxy:
    """See the module doc. ``decide`` returns one of :data:`ACTIONS` for each call."""

    upstream: str
    decide: Decide = lambda call: "forward"
    on_kill: Callable[[int], None] | None = None
    counts: Counter[str] = field(default_factory=Counter)
    log: list[tuple[int, str, str, str]] = field(default_factory=list)  # worker, op, key, action
    # Each receive SQS answered (its receipt handle -> the message's ID; a worker receives one
    # message at a time, as Held assumes), and what became of each delete of one (the actions
    # taken on it, "forward" for one sent on as it was).
    received: dict[str, str] = field(default_factory=dict)
    deletes: dict[str, list[str]] = field(default_factory=dict)
    latency_s: float = 0.0  # added to every request before it is forwarded (a distant endpoint)

    def __post_init__(self) -> None:
        self._aliases: dict[str, str] = {}  # receipt handles of redeliveries -> the real ones
        self._workers: dict[int, _Worker] = {}
        self._ports: dict[int, int] = {}
        self._sites: dict[int, web.TCPSite] = {}
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 31)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        self._session = ClientSession(
            auto_decompress=False, timeout=ClientTimeout(total=120), skip_auto_headers=("Accept",)
        )

    async def endpoint(self, worker: int) -> str:
        """The URL worker ``worker`` talks to (a port of its own)."""
        if worker not in self._sites:
            assert self._runner is not None, "start() first"
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._sites[worker], self._ports[port] = site, worker
            self._workers[worker] = _Worker()
        port = next(p for p, w in self._ports.items() if w == worker)
        return f"http://127.0.0.1:{port}"

    def kill(self, worker: int) -> None:
        """From now on, nothing ``worker`` sends reaches the endpoint."""
        state = self._workers.setdefault(worker, _Worker())
        if not state.dead:
            state.dead = True
            self.counts["killed_workers"] += 1
            if self.on_kill is not None:
                self.on_kill(worker)

    def dead(self, worker: int) -> bool:
        return self._workers.get(worker, _Worker()).dead

    def held_by(self, worker: int) -> Held | None:
        return self._workers.get(worker, _Worker()).held

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # -- one request -------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        worker = self._ports.get(sockname[1] if sockname else -1, -1)
        state = self._workers.setdefault(worker, _Worker())
        body = await request.read()
        if state.dead:
            return self._drop(request, "dead")
        call = self._call(request, body, worker, state)
        action = self.decide(call)
        self._record(call, action, body)
        early = self._before(request, call, action, body, state)
        if early is not None:
            return early
        if action == "delay":
            await asyncio.sleep(2.5)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if call.service == "sqs" and self._aliases:
            body = self._unalias(body)
        status, headers, data = await self._forward(request, body)
        if action == "duplicate" and call.op in ("SendMessage", "SendMessageBatch"):
            await self._forward(request, body)
        if call.op == "ReceiveMessage" and status == 200 and (held := _held(data)):
            state.held, state.received = held, data
            self.received[held.receipt] = held.message_id
        if action == "kill_after":
            self.kill(worker)
            return self._drop(request, "dead")
        if action == "kill_during":
            return await self._cut_off(request, status, headers, data, worker)
        if action == "lose_response":
            return self._drop(request, "lost")
        if action == "forbid_missing" and status == 404 and call.op in ("GetObject", "HeadObject"):
            return _error("s3", 403)
        return _response(request, status, headers, data)

    def _record(self, call: Call, action: str, body: bytes) -> None:
        """The action into :attr:`counts` and :attr:`log` (if not a plain forward), and a
        delete's into :attr:`deletes`."""
        if action != "forward":
            self.counts[action] += 1
            self.log.append((call.worker, call.op, call.key, action))
        if call.op in ("DeleteMessage", "DeleteMessageBatch"):
            for receipt in _receipts(self._unalias(body)):
                self.deletes.setdefault(receipt, []).append(action)

    def _before(
        self, request: web.Request, call: Call, action: str, body: bytes, state: _Worker
    ) -> web.StreamResponse | None:
        """The answer of an action that does not forward the request; None for one that does."""
        if action == "kill_before":
            self.kill(call.worker)
            return self._drop(request, "dead")
        if action in ("fail_503", "fail_500"):
            return _error(call.service, 503 if action == "fail_503" else 500)
        if action == "conflict_409" and call.service == "s3":
            return _error("s3", 409)
        if action == "missing" and call.op in ("GetObject", "HeadObject"):
            return _error("s3", 404)
        if action == "deny":
            return _error(call.service, 403)
        if action == "kms_disabled":
            return _error(call.service, 400)
        if action == "fake_delete" and call.op in ("DeleteMessage", "DeleteMessageBatch"):
            return _fake_delete(call.op, body)
        if action == "redeliver" and call.op == "ReceiveMessage":
            other = next(
                (w for n, w in self._workers.items() if n != call.worker and w.received), None
            )
            if other is not None and other.received is not None:
                again = self._second_delivery(other.received)
                state.held = _held(again)
                return web.Response(
                    status=200, body=again, content_type="application/x-amz-json-1.0"
                )
        return None

    def _second_delivery(self, received: bytes) -> bytes:
        """A ``ReceiveMessage`` answer as SQS gives it to a second consumer: each message with a
        receipt handle of its own and its receive count one higher."""
        doc = json.loads(received)
        for message in doc.get("Messages", []):
            handle = message["ReceiptHandle"]
            alias = f"{handle}~{len(self._aliases) + 1}"
            self._aliases[alias] = self._aliases.get(handle, handle)
            message["ReceiptHandle"] = alias
            attributes = message.setdefault("Attributes", {})
            attributes["ApproximateReceiveCount"] = str(
                int(attributes.get("ApproximateReceiveCount", "1")) + 1
            )
        return json.dumps(doc).encode()

    def _unalias(self, body: bytes) -> bytes:
        """An SQS request with the real receipt handles of redeliveries (see _second_delivery)."""
        if b"~" not in body:
            return body
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            doc = json.loads(body)
            for entry in [doc, *doc.get("Entries", [])]:
                if entry.get("ReceiptHandle") in self._aliases:
                    entry["ReceiptHandle"] = self._aliases[entry["ReceiptHandle"]]
            return json.dumps(doc).encode()
        return body

    async def _cut_off(
        self, request: web.Request, status: int, headers: Any, data: bytes, worker: int
    ) -> web.StreamResponse:
        """Send half of the answer, then kill the worker (a kill inside a request)."""
        response = _response(request, status, headers, data)
        stream = web.StreamResponse(status=status, headers=response.headers)
        stream.content_length = len(data)
        await stream.prepare(request)
        await stream.write(data[: len(data) // 2])
        self.kill(worker)
        self.counts["dropped_dead"] += 1
        if request.transport is not None:
            request.transport.close()
        return stream

    def _call(self, request: web.Request, body: bytes, worker: int, state: _Worker) -> Call:
        state.number += 1
        target = request.headers.get("X-Amz-Target", "")
        if target.startswith("AmazonSQS."):
            url = ""
            with contextlib.suppress(ValueError, AttributeError):
                url = str(json.loads(body or b"{}").get("QueueUrl", ""))
            return Call(worker, "sqs", target.split(".", 1)[1], url, state.number, state.held)
        form = parse_qs(body.decode("latin-1")) if b"Action=" in body[:200] else {}
        if "Action" in form:  # SQS's query protocol
            url = form.get("QueueUrl", [""])[0]
            return Call(worker, "sqs", form["Action"][0], url, state.number, state.held)
        query = parse_qs(request.query_string, keep_blank_values=True)
        op, key = s3_op(request.method, request.path, query, request.headers)
        conditional = "If-None-Match" in request.headers or "If-Match" in request.headers
        version = "versionId" in query
        return Call(worker, "s3", op, key, state.number, state.held, conditional, version)

    async def _forward(self, request: web.Request, body: bytes) -> tuple[int, Any, bytes]:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        headers["Host"] = request.headers.get("Host", "")
        url = f"{self.upstream}{request.rel_url}"
        async with self._session.request(
            request.method, url, headers=headers, data=body, allow_redirects=False
        ) as answer:
            data = await answer.read()
            return answer.status, answer.headers, data

    def _drop(self, request: web.Request, why: str) -> web.StreamResponse:
        """Close the connection without an answer (botocore sees a reset and may retry)."""
        self.counts[f"dropped_{why}"] += 1
        if request.transport is not None:
            request.transport.close()
        return web.Response(status=500)


def _receipts(body: bytes) -> list[str]:
    """The receipt handles a DeleteMessage(Batch) request names."""
    with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
        doc = json.loads(body)
        return [e["ReceiptHandle"] for e in doc.get("Entries") or [doc] if "ReceiptHandle" in e]
    return []


def _held(data: bytes) -> Held | None:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        messages = json.loads(data).get("Messages") or []
        if messages:
            message = messages[0]
            count = int(message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
            receipt = str(message.get("ReceiptHandle", ""))
            return Held(message["Body"], count, receipt, str(message.get("MessageId", "")))
    return None


def _response(request: web.Request, status: int, headers: Any, data: bytes) -> web.Response:
    keep = {
        k: v
        for k, v in headers.items()
        if k.lower() not in HOP and k.lower() not in ("content-encoding", "date", "server")
    }
    if request.method == "HEAD":
        # A HEAD answer has no body but says how long the object is: keep S3's Content-Length.
        response = web.Response(status=status, headers=keep)
        if "Content-Length" in headers:
            response.headers["Content-Length"] = headers["Content-Length"]
        return response
    if "Content-Encoding" in headers:
        keep["Content-Encoding"] = headers["Content-Encoding"]
    return web.Response(status=status, headers=keep, body=data)


def _error(service: str, status: int) -> web.Response:
    if service == "sqs":
        code = "InternalError" if status >= 500 else "AccessDenied"
        body = json.dumps({"__type": f"com.amazonaws.sqs#{code}", "message": "injected"})
        return web.Response(
            status=status, body=body.encode(), content_type="application/x-amz-json-1.0"
        )
    code, message = {
        503: ("SlowDown", "Please reduce your request rate."),
        500: ("InternalError", "We encountered an internal error. Please try again."),
        403: ("AccessDenied", "Access Denied"),
        400: ("KMS.DisabledException", "The KMS key is disabled."),
        409: (
            "ConditionalRequestConflict",
            "A conflicting conditional operation is currently in progress against this resource.",
        ),
        404: ("NoSuchKey", "The specified key does not exist."),
    }[status]
    xml = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>"
    return web.Response(status=status, body=xml.encode(), content_type="application/xml")


def _fake_delete(op: str, body: bytes) -> web.Response:
    doc: dict[str, Any] = {}
    if op == "DeleteMessageBatch":
        entries = json.loads(body or b"{}").get("Entries", [])
        doc = {"Successful": [{"Id": e["Id"]} for e in entries], "Failed": []}
    return web.Response(
        status=200, body=json.dumps(doc).encode(), content_type="application/x-amz-json-1.0"
    )
