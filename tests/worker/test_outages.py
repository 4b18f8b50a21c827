"""Store and queue faults never fail a line (issue 27): which faults count towards a message's tries,
the circuit breaker, and fleets behind the fault proxy meeting outages on a shard's or a job's last
try, and 409s on the conditional writes."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any
from urllib.parse import unquote_plus

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from tests.aws import aws_clients, list_keys, read_object, receive_all, wait_for
from tests.faults.fleet import Fleet
from tests.faults.proxy import Call
from tests.faults.scenarios import (
    Rule,
    drop,
    fault_settings,
    finished,
    numbered_body,
    rules,
    run_fleet,
    versioned_stack,
)
from tests.worker.fanout_support import sample
from worker.breaker import CircuitBreaker
from worker.fanout.deadletters import RecordsInFlight
from worker.fanout.status import Contended
from worker.faults import Fault, QueueRefused, classify
from worker.jobs import InputDenied, JobFailed
from worker.metrics import WorkerMetrics
from worker.outputs import output_keys
from worker.s3io import WriteConflict


def _client_error(code: str, status: int, operation: str = "GetObject") -> ClientError:
    response: Any = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, operation)


def _from(exc: BaseException, cause: BaseException) -> BaseException:
    exc.__cause__ = cause
    return exc


def test_only_the_engine_and_the_data_count_towards_the_tries() -> None:
    store = [
        _client_error("SlowDown", 503),
        _client_error("InternalError", 500, "PutObject"),
        _client_error("ConditionalRequestConflict", 409, "PutObject"),
        _client_error("AccessDenied", 403),
        _client_error("RequestTimeout", 400),
        EndpointConnectionError(endpoint_url="http://s3"),
        ReadTimeoutError(endpoint_url="http://s3"),
        _from(JobFailed("cannot read s3://jobs/x"), _client_error("SlowDown", 503)),
        WriteConflict("a concurrent write"),
        TimeoutError(),
    ]
    queue = [
        _client_error("InternalError", 500, "SendMessage"),
        _client_error("RequestThrottled", 400, "ReceiveMessage"),
        QueueRefused("SQS refused 3 fan-out messages"),
    ]
    work = [
        _client_error("NoSuchKey", 404),
        _client_error("InvalidRange", 416),
        JobFailed("the engine failed on every decision so far (8)"),
        RuntimeError("this engine cannot score poison"),
        _from(JobFailed("shard 1 has 7 items, not 8"), ValueError("damaged")),
        _from(InputDenied("the input cannot be read"), _client_error("AccessDenied", 403)),
    ]
    race = [Contended("the status stayed contended"), RecordsInFlight("claimed by another end")]
    assert [classify(e) for e in store] == [Fault.STORE] * len(store)
    assert [classify(e) for e in race] == [Fault.RACE] * len(race)
    assert [classify(e) for e in queue] == [Fault.QUEUE] * len(queue)
    assert [classify(e) for e in work] == [Fault.WORK] * len(work)
    assert Fault.WORK.counts and not Fault.STORE.counts and not Fault.QUEUE.counts
    assert not Fault.RACE.counts


async def test_the_breaker_opens_once_probes_with_doubling_delays_and_closes_once() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    answers = [RuntimeError("SlowDown"), RuntimeError("SlowDown"), None]
    waits: list[float] = []

    async def probe() -> None:
        waits.append(time.monotonic())
        answer = answers.pop(0)
        if answer is not None:
            raise answer

    breaker = CircuitBreaker("store", metrics, probe, base_s=0.05, max_s=1.0)
    stop = asyncio.Event()
    with capture_logs() as logs:
        assert await breaker.wait(stop)  # a fresh worker probes before its first receive
        breaker.succeeded()
    events = [e["event"] for e in logs]
    assert events == ["store.unavailable", "store.available"]  # one line each way
    gaps = [b - a for a, b in itertools.pairwise(waits)]
    assert len(waits) == 3 and 0.04 < gaps[0] < gaps[1]  # 0.05 s, then 0.1 s
    assert registry.get_sample_value("arbiter_worker_circuit_opens_total", {"dependency": "store"})
    assert registry.get_sample_value("arbiter_worker_circuit_open", {"dependency": "store"}) == 0
    breaker.trip("SlowDown")
    stop.set()
    assert not await breaker.wait(stop)  # stopping ends the wait


async def test_a_store_outage_on_a_shards_only_try_spends_no_try_and_fails_no_line(
    endpoint: str,
) -> None:
    """Shard 1's input read and then its records' upload answered 503 SlowDown (botocore sends
    each request 3 times), with one try allowed: before issue 27 that receive was the shard's
    last try, and its good lines became ``shard_failed``."""
    settings = fault_settings(endpoint, max_receive_count=1)

    def shard_input(call: Call) -> bool:
        return call.op == "GetObject" and call.key.endswith("/in/00001")

    def shard_records(call: Call) -> bool:
        return call.op == "PutObject" and "/out/00001." in call.key

    reads, upload = Rule(shard_input, "fail_503", times=2 * 3), Rule(shard_records, "fail_503", 3)
    body = numbered_body(12)
    bad, jobs, _ = await run_fleet(
        endpoint, settings, rules(reads, upload), {"incoming/o.jsonl": body}
    )
    async with aws_clients(endpoint) as (s3, _):
        keys = output_keys(settings, jobs[0].key, jobs[0].etag)
        summary = json.loads(await read_object(s3, "jobs", keys.summary))
    assert reads.hits == 6 and upload.hits == 3
    assert bad == []  # every line once, as the single path writes it, and an empty DLQ
    assert summary["shards"]["failed"] == [] and summary["failed"] == 0


async def test_a_store_outage_on_a_jobs_last_try_does_not_dead_letter_it(endpoint: str) -> None:
    """A small job's input answered 503 on its first 4 receives, with one try allowed: before
    issue 27 its second receive was past its tries, and after a last look it went to the DLQ."""
    settings = fault_settings(endpoint, max_receive_count=1, shard_lines=0)

    def job_input(call: Call) -> bool:
        return call.op == "GetObject" and call.key == "incoming/small.jsonl"

    outage = Rule(job_input, "fail_503", times=4 * 3)
    bad, _, _ = await run_fleet(
        endpoint, settings, outage, {"incoming/small.jsonl": numbered_body(5)}
    )
    assert outage.hits == 12 and bad == []


async def test_409s_on_the_conditional_writes_are_retried_where_412s_are(endpoint: str) -> None:
    """S3 answers a conditional write 409 ``ConditionalRequestConflict`` while another is in
    flight (moto never does): the status's compare-and-swap reads again, a create-once write
    (outcome, manifest, summary) is sent again, and no receive fails for it."""
    settings = fault_settings(endpoint, max_receive_count=1)
    seen: list[str] = []

    def conditional(call: Call) -> bool:
        if call.service == "s3" and call.op == "PutObject" and call.conditional:
            seen.append(call.key.rsplit("/", 1)[-1])
            return len(seen) % 2 == 1  # every other conditional write meets a 409
        return False

    conflicts = Rule(conditional, "conflict_409", times=40)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await versioned_stack(s3, sqs, settings)
        job = await drop(s3, settings, "incoming/c.jsonl", numbered_body(12))
        async with Fleet(endpoint, settings, conflicts, 2) as fleet:
            await fleet.run_until(finished(s3, sqs, stack, settings, [job]), 60)
            registries = fleet.registries()
            failed = sample(registries, "arbiter_worker_jobs_total", outcome="failed")
            outages = sample(registries, "arbiter_worker_outage_retries_total", dependency="store")
    names = {name.split(".")[0] for name in seen}
    assert conflicts.hits >= 8 and {"manifest", "00000", "00001", "00002"} <= names
    assert any(name.endswith("status.json") for name in seen)
    assert failed == 0 and outages == 0  # absorbed where they happened: no receive failed


async def test_a_fresh_worker_takes_nothing_while_the_store_is_down(endpoint: str) -> None:
    """Every S3 request refused: a worker started meanwhile probes the store and receives no
    message until it answers again; one log line when it found the store down, one when back."""
    settings = fault_settings(endpoint, circuit_probe_s=0.5, circuit_probe_max_s=1.0)
    down = True
    receives_while_down: list[int] = []

    def decide(call: Call) -> str:
        if down and call.op == "ReceiveMessage":
            receives_while_down.append(call.number)
        return "fail_503" if down and call.service == "s3" else "forward"

    async with aws_clients(endpoint) as (s3, sqs):
        stack = await versioned_stack(s3, sqs, settings)
        job = await drop(s3, settings, "incoming/d.jsonl", numbered_body(6))
        with capture_logs() as logs:
            async with Fleet(endpoint, settings, decide, 1) as fleet:

                async def opened() -> bool:
                    gauge = "arbiter_worker_circuit_open"
                    return sample(fleet.registries(), gauge, dependency="store") == 1

                await wait_for(opened, within_s=30)
                await asyncio.sleep(2)  # a few probes more, and no receive
                down = False
                await fleet.run_until(finished(s3, sqs, stack, settings, [job]), 60)
                registries = fleet.registries()
    events = [e["event"] for e in logs if e["event"].startswith("store.")]
    assert receives_while_down == []
    assert events == ["store.unavailable", "store.available"]
    assert sample(registries, "arbiter_worker_circuit_opens_total", dependency="store") == 1
    assert sample(registries, "arbiter_worker_circuit_open", dependency="store") == 0


@pytest.mark.parametrize("refusal", ["deny", "kms_disabled"])
async def test_an_input_the_role_may_not_read_is_rejected_with_its_record(
    endpoint: str, refusal: str
) -> None:
    """Issue 36: an input encrypted with a KMS key the role may not use (403 AccessDenied), or
    with a disabled one (KMS.DisabledException), was given back as a store outage for a day,
    opened a breaker on every receive, then went to the DLQ without a rejection record, so
    ``arbiter submit`` waited out its timeout. The listing shows the object is there, so the
    refusal is the object's own: it counts as a try, and on the last the job is rejected with
    its record, while the other job on the same store runs."""
    settings = fault_settings(endpoint, max_receive_count=2, shard_lines=0)

    def input_read(call: Call) -> bool:
        return call.op == "GetObject" and call.key == "incoming/sealed.jsonl"

    refused = Rule(input_read, refusal, times=10**6)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await versioned_stack(s3, sqs, settings)
        sealed = await drop(s3, settings, "incoming/sealed.jsonl", numbered_body(3))
        fine = await drop(s3, settings, "incoming/fine.jsonl", numbered_body(3))
        keys = output_keys(settings, sealed.key, sealed.etag)
        async with Fleet(endpoint, settings, refused, 1) as fleet:

            async def told() -> bool:
                return keys.rejected in await list_keys(s3, "jobs", keys.rejected)

            await wait_for(told, within_s=30)
            await fleet.run_until(finished(s3, sqs, stack, settings, [fine]), 30)
            registries = fleet.registries()
        record = json.loads(await read_object(s3, "jobs", keys.rejected))
        dead = await receive_all(sqs, stack["dlq_url"], wait=1)
    assert "cannot be read" in record["rejected"] and "on each of its 2 tries" in record["rejected"]
    keys_dead = [json.loads(m["Body"])["Records"][0]["s3"]["object"]["key"] for m in dead]
    assert [unquote_plus(k) for k in keys_dead] == [sealed.key]
    assert sample(registries, "arbiter_worker_circuit_opens_total", dependency="store") == 0
    assert refused.hits == 2  # one read per try: a refusal is not sent again
