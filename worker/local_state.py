"""The local S3 + SQS server's state, kept in a file between runs of `arbiter local`.

Why keep it: everything the stack accepted lives there (a job's input and its queue message, an
async request's backlog message and its input), so a stop that dropped it would leave the caller
a 202 and an ``OutputLocation`` that is never written. A developer who stops a stack and
starts it again expects what it accepted to be answered, as a restarted service on AWS would.

How: moto keeps each service's state in plain Python objects (its "backends"), which pickle (moto
makes S3 keys picklable itself; a queue's lock is made anew). At a stop, once every part has
stopped and the server with them, the S3, SQS and SNS backends are written to the file (atomically,
mode 0600); at the next start, before the server answers, they are put back. Objects keep their
ETags (a multipart one too), messages their receive counts and visibility (one a killed worker
held comes back when its timeout lapses), buckets their notifications. A file written by another
moto release, or one that cannot be read, is refused in one line (``--fresh`` discards it), never
dropped quietly. What a SIGKILL of `arbiter local` itself interrupts is not saved: that run's
changes are lost, the previous file stays.
"""

from __future__ import annotations

import contextlib
import copyreg
import json
import os
import pickle
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote_plus

from arbiter.errors import ArbiterError

SERVICES = ("s3", "sqs", "sns")
FORMAT = 1
_RLOCK = type(threading.RLock())
_LOCK = type(threading.Lock())


@dataclass(frozen=True)
class Held:
    """What the state holds, for the start-up and stop lines."""

    objects: int
    buckets: int
    messages: int
    queues: int

    def __str__(self) -> str:
        return (
            f"{self.objects} objects in {self.buckets} buckets, {self.messages} messages in "
            f"{self.queues} queues"
        )


def _moto_version() -> str:
    import moto

    return str(moto.__version__)


def _backends() -> dict[str, Any]:
    from moto.backends import get_backend

    return {name: get_backend(name) for name in SERVICES}  # type: ignore[call-overload]


def held() -> Held:
    """Counted from the backends as they are now."""
    objects = buckets = messages = queues = 0
    for regions in _backends()["s3"].values():
        for backend in regions.values():
            for bucket in backend.buckets.values():
                buckets += 1
                objects += len(bucket.keys)
    for regions in _backends()["sqs"].values():
        for backend in regions.values():
            for queue in backend.queues.values():
                queues += 1
                messages += len(queue._messages)
    return Held(objects, buckets, messages, queues)


def unanswered() -> list[str]:
    """Each request the queues still hold, named for a user (an async request by its inference id
    and output location, a job by its input object): what a stop loses when the state is not kept."""
    named = []
    for regions in _backends()["sqs"].values():
        for backend in regions.values():
            for queue in backend.queues.values():
                for message in queue._messages:
                    name = _name(message.body, queue.name)
                    if name is not None:
                        named.append(name)
    return named


def _name(body: str, queue: str) -> str | None:
    try:
        raw = json.loads(body)
    except ValueError:
        raw = None
    if isinstance(raw, dict) and raw.get("Event") == "s3:TestEvent":
        return None  # S3's own test of a new notification: no request
    if isinstance(raw, dict) and isinstance(raw.get("inference_id"), str):
        return f"async request {raw['inference_id']} (its output: {raw.get('output')})"
    if isinstance(raw, dict) and ("arbiter_shard" in raw or "arbiter_merge" in raw):
        part = "a shard" if "arbiter_shard" in raw else "the merge"
        return f"{part} of job s3://{raw.get('bucket')}/{raw.get('key')} (queue {queue})"
    records = raw.get("Records") if isinstance(raw, dict) else None
    if isinstance(records, list):
        with contextlib.suppress(KeyError, TypeError):
            keys = [
                f"s3://{r['s3']['bucket']['name']}/{unquote_plus(r['s3']['object']['key'])}"
                for r in records
            ]
            return f"job {', '.join(keys)} (queue {queue})"
    return f"a message in queue {queue}: {body[:80]!r}"


def save(path: Path) -> Held:
    """Write the backends to ``path`` (the server stopped: nothing changes them meanwhile)."""
    state = {
        name: {
            "backends": {account: dict(regions) for account, regions in backend.items()},
            # What a service keeps beside its backends: S3's bucket -> account map, without
            # which a restored bucket is unknown to CreateBucket and made anew, empty.
            "shared": {k: v for k, v in vars(backend).items() if isinstance(v, dict)},
        }
        for name, backend in _backends().items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
        # A queue's condition and a backend's locks are made anew, unlocked, when read back.
        table = copyreg.dispatch_table.copy()
        table[threading.Condition] = lambda _: (threading.Condition, ())
        table[_RLOCK] = lambda _: (threading.RLock, ())
        table[_LOCK] = lambda _: (threading.Lock, ())
        pickler.dispatch_table = table
        pickler.dump({"format": FORMAT, "moto": _moto_version()})
        pickler.clear_memo()  # the header is read by an unpickler of its own
        pickler.dump(state)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
    return held()


def load(path: Path) -> Held | None:
    """Put the state kept in ``path`` back (None if there is none); refused in one line if it
    cannot be, as dropping it would lose what the last run accepted."""
    if not path.exists():
        return None
    fresh = f"start with --fresh to discard it (what it holds is lost), or move {path} away"
    try:
        with path.open("rb") as source:
            header = pickle.load(source)
            if not isinstance(header, dict) or header.get("format") != FORMAT:
                raise ArbiterError(f"refused: {path} is not a state file of this release; {fresh}")
            if header.get("moto") != _moto_version():
                raise ArbiterError(
                    f"refused: {path} holds the local S3 + SQS state of moto {header.get('moto')}, "
                    f"this is moto {_moto_version()}; {fresh}"
                )
            state = pickle.load(source)
    except ArbiterError:
        raise
    except Exception as exc:
        raise ArbiterError(f"refused: {path} cannot be read ({exc!r}); {fresh}") from exc
    backends = _backends()
    for name, kept in state.items():
        for account, regions in kept["backends"].items():
            for region, backend in regions.items():
                backends[name][account][region] = backend
        for attribute, value in kept["shared"].items():
            getattr(backends[name], attribute).update(value)
    return held()


def discard(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
