"""Each way issue 19 found to leave a job unfinished, or its summary untrue, as a test: a fleet of
consumers behind the fault proxy meets the fault, and every invariant of tests/faults/invariants.py
holds after (every line once and in order, the single path's records, a true summary, a finished
status, nothing left behind, an empty DLQ unless a shard truly ran out of tries)."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
from typing import Any

import pytest

from tests.aws import aws_clients, list_keys, read_object, receive_all
from tests.fakes import FakeEngine, decision_line
from tests.faults.fleet import Fleet
from tests.faults.invariants import violations
from tests.faults.proxy import Call
from tests.faults.scenarios import (
    OncePerKey,
    PoisonEngine,
    Rule,
    rules,
)
from tests.faults.scenarios import (
    drop as _drop,
)
from tests.faults.scenarios import (
    fault_settings as _settings,
)
from tests.faults.scenarios import (
    finished as _finished,
)
from tests.faults.scenarios import (
    holding as _held,
)
from tests.faults.scenarios import (
    numbered_body as _body,
)
from tests.faults.scenarios import (
    run_fleet as _run,
)
from tests.faults.scenarios import (
    versioned_stack as _stack,
)
from tests.worker.fanout_support import sample
from worker.context import QueueInfo, WorkerContext
from worker.events import parse_message
from worker.outputs import output_keys
from worker.submit import submit
from worker.tries import Tries

# -- 1, 2, 3: a committed write whose answer was lost --------------------------------------------


async def test_1_a_lost_answer_to_a_shards_outcome_write_does_not_delete_its_output(
    endpoint: str,
) -> None:
    """botocore resends the write; the resend meets the worker's own outcome and counts as it."""
    settings = _settings(endpoint)
    lose = OncePerKey(
        lambda c: (
            c.op == "PutObject"
            and c.conditional
            and c.key.startswith("shards/")
            and not c.key.endswith("manifest.json")
        ),
        "lose_response",
    )
    bad, _, fleet = await _run(endpoint, settings, lose, {"incoming/lost.jsonl": _body(16)})
    assert fleet.proxy.counts["lose_response"] >= 4
    assert bad == []


async def test_2_a_lost_answer_to_the_manifest_write_does_not_make_the_splitter_lose_to_itself(
    endpoint: str,
) -> None:
    settings = _settings(endpoint)
    lose = Rule(lambda c: c.op == "PutObject" and c.key.endswith("/manifest.json"), "lose_response")
    bad, _, fleet = await _run(endpoint, settings, lose, {"incoming/manifest.jsonl": _body(12)})
    assert fleet.proxy.counts["lose_response"] == 1
    assert bad == []


async def test_3_a_lost_answer_to_the_summary_write_still_finishes_the_status_and_cleans_up(
    endpoint: str,
) -> None:
    settings = _settings(endpoint)
    lose = Rule(lambda c: c.op == "PutObject" and c.key.endswith(".summary.json"), "lose_response")
    bad, _, fleet = await _run(endpoint, settings, lose, {"incoming/summary.jsonl": _body(12)})
    assert fleet.proxy.counts["lose_response"] == 1
    assert bad == []


async def test_3_a_lost_answer_to_a_failed_shards_outcome_still_merges_the_job(
    endpoint: str,
) -> None:
    """A shard out of tries (its last try killed) is failed without running; that outcome's
    answer is lost too: the resend meets it and the job still merges."""
    settings = _settings(endpoint, max_receive_count=1)

    def is_shard_1(call: Call) -> bool:
        return _held(call, "shard") and json.loads(call.held.body)["index"] == 1  # type: ignore[union-attr]

    kill = Rule(lambda c: is_shard_1(c) and c.op == "GetObject", "kill_before")
    lose = Rule(
        lambda c: is_shard_1(c) and c.op == "PutObject" and "/outcome/" in c.key, "lose_response"
    )
    bad, _, _fleet = await _run(
        endpoint, settings, rules(kill, lose), {"incoming/f.jsonl": _body(12)}
    )
    assert (kill.hits, lose.hits) == (1, 1)
    assert bad == []


# -- 4, 5: tries ---------------------------------------------------------------------------------


async def test_4_a_merge_that_fails_on_the_store_outlives_the_redrive_and_spends_no_tries(
    endpoint: str,
) -> None:
    """S3 refuses the merge's completion (a 500: the store's fault) on more receives than the
    redrive allows (2 tries + its margin of 3): each failed receive gives the merge back as a new
    message carrying its count, so SQS's redrive never moves it and no try is spent; once S3 is
    well the job finishes by itself. (Issue 19 stopped a merge from spending a shard's tries, but
    the redrive then moved it to the DLQ and the job waited for a re-send: issue 27.)"""
    settings = _settings(endpoint, max_receive_count=2)
    receives: list[int] = []

    def refused(call: Call) -> bool:
        if call.op == "CompleteMultipartUpload" and call.held is not None:
            receives.append(call.held.receive_count)
            return True
        return False

    # botocore sends each request 5 times: six receives of the merge refused.
    broken = Rule(refused, "fail_500", times=6 * 5)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        job = await _drop(s3, settings, "incoming/merge.jsonl", _body(12))
        async with Fleet(endpoint, settings, broken, 2) as fleet:
            await fleet.run_until(_finished(s3, sqs, stack, settings, [job]), 90)
            retried = sample(
                fleet.registries(), "arbiter_worker_outage_retries_total", dependency="store"
            )
        bad = await violations(s3, sqs, stack, settings, [job])
    assert broken.hits == 30 and set(receives) == {1}  # each receive a fresh copy's first
    assert retried >= 6
    assert bad == []  # every line once, no shard failed, a true summary, an empty DLQ


async def _no_visible(sqs: Any, url: str) -> bool:
    got = await sqs.get_queue_attributes(
        QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"]
    )
    return got["Attributes"]["ApproximateNumberOfMessages"] == "0"


async def test_5_a_shard_whose_worker_dies_on_its_last_try_is_failed_and_its_job_finishes(
    endpoint: str,
) -> None:
    """The redrive allows three receives more than the worker's tries: the worker sees the
    receive after the last try and fails the shard without running it."""
    settings = _settings(endpoint, max_receive_count=2)

    def shard_1_tried(call: Call) -> bool:
        held = call.held
        return (
            _held(call, "shard")
            and json.loads(held.body)["index"] == 1  # type: ignore[union-attr]
            and held.receive_count <= 2  # type: ignore[union-attr]
            and call.op == "GetObject"
        )

    kill = Rule(shard_1_tried, "kill_before", times=2)
    bad, _, fleet = await _run(endpoint, settings, kill, {"incoming/dies.jsonl": _body(12)})
    assert kill.hits == 2 and fleet.kills == 2
    assert bad == []  # shard 1's lines are shard_failed, counted, and it has its DLQ record


async def test_5_a_merge_whose_worker_dies_on_every_try_is_merged_after_them(
    endpoint: str,
) -> None:
    settings = _settings(endpoint, max_receive_count=2)
    kill = Rule(
        lambda c: _held(c, "merge") and c.op == "CreateMultipartUpload", "kill_before", times=2
    )
    bad, _, _fleet = await _run(endpoint, settings, kill, {"incoming/merger.jsonl": _body(12)})
    assert kill.hits == 2
    assert bad == []


# -- 6, 7, 8, 9 ----------------------------------------------------------------------------------


async def test_6_the_same_input_run_again_after_its_outputs_were_deleted_is_scored_again(
    endpoint: str,
) -> None:
    settings = _settings(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        job = await _drop(s3, settings, "incoming/again.jsonl", _body(12))
        async with Fleet(endpoint, settings, workers=2) as fleet:
            await fleet.run_until(_finished(s3, sqs, stack, settings, [job]), 60)
            keys = output_keys(settings, job.key, job.etag)
            for key in (keys.results, keys.summary):  # the user deletes the outputs...
                versions = await s3.list_object_versions(Bucket="jobs", Prefix=key)
                for v in versions.get("Versions", []):
                    await s3.delete_object(Bucket="jobs", Key=key, VersionId=v["VersionId"])
            body = json.dumps({"bucket": "jobs", "key": job.key})  # ...and sends it again
            await sqs.send_message(QueueUrl=stack["queue_url"], MessageBody=body)
            await fleet.run_until(_finished(s3, sqs, stack, settings, [job]), 60)
        bad = await violations(s3, sqs, stack, settings, [job])
    assert bad == []


async def test_7_good_lines_of_a_shard_that_starts_with_raising_decisions_are_scored(
    endpoint: str,
) -> None:
    """Shard 1's first chunk all raises; its other lines are good: they get results, the raising
    ones engine_failure, exactly as the single path writes them."""
    settings = _settings(endpoint, shard_lines=6, chunk_decisions=2, max_receive_count=2)
    states = [f"S{i}" for i in range(18)]
    states[6] = states[7] = "POISON"
    bodies = {"incoming/poison.jsonl": _body(18, states)}
    bad, jobs, _ = await _run(
        endpoint, settings, lambda c: "forward", bodies, engine=lambda n: PoisonEngine()
    )
    assert jobs[0].expected is not None
    assert [r["line"] for r in jobs[0].expected if "error" in r] == [7, 8]
    assert bad == []  # the invariants compare each line with the single path's
    async with aws_clients(endpoint) as (s3, _):
        keys = output_keys(settings, jobs[0].key, jobs[0].etag)
        summary = json.loads(await read_object(s3, "jobs", keys.summary))
    assert summary["shards"]["failed"] == [] and summary["errors_by_code"] == {"engine_failure": 2}


async def test_8_a_shard_scored_and_failed_at_once_has_one_outcome_and_a_true_summary(
    endpoint: str,
) -> None:
    """One attempt scores shard 1 while another fails it (its last try died): both publish at
    the same moment. One outcome object per shard, first write wins: never done and failed both,
    and the summary adds up what the results hold."""
    from worker.fanout import FanOut
    from worker.fanout.keys import job_folder
    from worker.fanout.outcome import publish
    from worker.fanout.plan import read_manifest

    settings = _settings(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        job = await _drop(s3, settings, "incoming/both.jsonl", _body(12))
        fanout = FanOut(
            WorkerContext(
                settings,
                s3,
                sqs,
                FakeEngine(),
                QueueInfo(stack["queue_url"], None, stack["dlq_url"]),
                Tries(2),
            )
        )
        await fanout.run(
            parse_message(
                json.dumps({"bucket": "jobs", "key": job.key}),
                bucket="jobs",
                input_prefix="incoming/",
            )[0]
        )  # type: ignore[arg-type]
        folder = job_folder(settings, "jobs", job.key, job.etag)
        manifest = await read_manifest(s3, "jobs", folder)
        assert manifest is not None
        span = manifest.shards[1]
        done = await fanout.work.score(folder, manifest, span, last_try=False)
        failed = await fanout.work.fail(folder, manifest, span, "its last try died", 3)
        first, second = await asyncio.gather(
            publish(s3, "jobs", folder, done), publish(s3, "jobs", folder, failed)
        )
        assert first is not None and second is not None
        (a, a_mine), (b, b_mine) = first, second
        outputs = [k for k in await list_keys(s3, "jobs", f"{folder.base}out/00001.")]
        async with Fleet(endpoint, settings, workers=2) as fleet:
            await fleet.run_until(_finished(s3, sqs, stack, settings, [job]), 60)
        found = await violations(s3, sqs, stack, settings, [job])
    # (a failed shard published here, not by a worker, has no DLQ record: not this test's point)
    bad = [v for v in found if "without a DLQ record" not in v]
    assert a == b and a_mine != b_mine  # one outcome, the same for both writers
    assert outputs == [a.output]  # the loser's records are gone
    assert bad == []


async def test_a_shard_failed_as_its_job_ends_sends_no_dlq_record(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Campaign seed 1005: a worker past a shard's tries fails it while another scores it; the
    other's outcome wins, the merge ends the job and deletes its folder, and only then does the
    failing worker read back the outcome that beat it: none. It took its own failed outcome for
    the shard's and sent a DLQ record for a shard the results hold as done."""
    from worker.fanout import FanOut, outcome
    from worker.fanout.keys import job_folder
    from worker.fanout.messages import shard_body
    from worker.fanout.plan import read_manifest
    from worker.tries import Receive

    settings = _settings(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        job = await _drop(s3, settings, "incoming/late.jsonl", _body(12))
        fanout = FanOut(
            WorkerContext(
                settings,
                s3,
                sqs,
                FakeEngine(),
                QueueInfo(stack["queue_url"], None, stack["dlq_url"]),
                Tries(2),
            )
        )
        ref = parse_message(
            json.dumps({"bucket": "jobs", "key": job.key}), bucket="jobs", input_prefix="incoming/"
        )[0]
        await fanout.run(ref)  # type: ignore[arg-type]
        folder = job_folder(settings, "jobs", job.key, job.etag)
        manifest = await read_manifest(s3, "jobs", folder)
        assert manifest is not None and manifest.count >= 2
        keys = output_keys(settings, job.key, job.etag)
        for span in manifest.shards[1:]:  # every other shard done, by other workers
            published = await outcome.publish(
                s3, "jobs", folder, await fanout.work.score(folder, manifest, span, last_try=False)
            )
            assert published is not None
        real_put_new = outcome.put_new

        async def the_race(s3_: Any, bucket: str, key: str, doc: Any) -> bool:
            if key == folder.outcome(0) and doc["state"] == "failed":
                # The other worker publishes first, and the merge ends the job ...
                won = await fanout.work.score(folder, manifest, manifest.shards[0], last_try=True)
                assert await outcome.publish(s3, "jobs", folder, won) is not None
                written = await real_put_new(s3_, bucket, key, doc)  # ... so this write loses
                await fanout.merger.merge(manifest, keys, folder)
                return written
            return await real_put_new(s3_, bucket, key, doc)

        monkeypatch.setattr(outcome, "put_new", the_race)
        shard0 = parse_message(shard_body(manifest, 0), bucket="jobs", input_prefix="incoming/")[0]
        await fanout.run(
            shard0, Receive(4, message_id="late")
        )  # 2 past the 2 tries: fails the shard
        dead = await receive_all(sqs, stack["dlq_url"], wait=0)
        # The split's shard messages were never taken by a worker here: the job ended without them.
        await sqs.purge_queue(QueueUrl=stack["queue_url"])
        found = await violations(s3, sqs, stack, settings, [job])
    assert dead == []
    assert found == []


async def test_9_a_failed_shard_whose_input_is_gone_still_has_one_record_per_line(
    endpoint: str,
) -> None:
    """Shard 1's input is gone (deleted, expired) as the workers see it: the shard fails at once,
    with a shard_failed record for each of its lines, numbered from the plan (blank lines kept
    out), so the summary counts what the results hold."""
    settings = _settings(endpoint)
    lines = [decision_line(i, state=f"S{i}") for i in range(12)]
    lines.insert(6, "")  # a blank line inside shard 1: no record, and none invented
    gone = Rule(lambda c: c.op == "GetObject" and "/in/00001" in c.key, "missing", times=10**6)
    bodies = {"incoming/gone.jsonl": "\n".join(lines).encode()}
    bad, jobs, _ = await _run(endpoint, settings, gone, bodies)
    assert gone.hits >= 2  # scored, then failed: both found it gone
    assert 7 not in jobs[0].numbers
    assert bad == []  # lines 5, 6, 8, 9 of shard 1 are shard_failed and counted


# -- 10, 11, 12, 13, 14 --------------------------------------------------------------------------


async def test_10_a_key_holding_another_jobs_folder_name_does_not_share_its_shards(
    endpoint: str,
) -> None:
    settings = _settings(endpoint)
    first = _body(12)
    etag = hashlib.md5(first).hexdigest()
    bodies = {
        "incoming/a.jsonl": first,
        f"incoming/a.jsonl.{etag}/b.jsonl": _body(16),  # the old folder of the first, as a prefix
    }
    bad, _, _ = await _run(endpoint, settings, lambda c: "forward", bodies, workers=3)
    assert bad == []


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
async def test_11_a_job_beyond_the_most_shards_is_refused_with_a_clear_error(
    endpoint: str, monkeypatch: pytest.MonkeyPatch, suffix: str, tmp_path: Any
) -> None:
    """Refused with the limit named, and before the split (issue 27): the input is read and cut
    without a write, so no shard input is uploaded only to be deleted, for a plain and a
    compressed input alike."""
    from worker.fanout import plan, split

    monkeypatch.setattr(split, "MAX_SHARDS", 3)
    monkeypatch.setattr(plan, "MAX_SHARDS", 3)
    settings = _settings(endpoint)
    writes: list[str] = []
    sent: list[int] = []  # shard inputs handed to the uploader (its tasks may be cancelled unsent)
    send = split._Uploader.send

    async def counted_send(self: Any, shard: Any) -> None:
        sent.append(shard.index)
        await send(self, shard)

    monkeypatch.setattr(split._Uploader, "send", counted_send)

    def watch(call: Call) -> str:
        if call.service == "s3" and call.op in ("PutObject", "CreateMultipartUpload"):
            writes.append(call.key)
        return "forward"

    job = tmp_path / f"huge{suffix}"
    job.write_bytes(gzip.compress(_body(20)) if suffix.endswith(".gz") else _body(20))
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        async with Fleet(endpoint, settings, watch, workers=1) as fleet:
            # As a user would: `arbiter submit` is told at once, not after its timeout.
            told = asyncio.create_task(submit(settings, job, timeout_s=30, progress=False))
            dead = await _wait_dead(fleet, sqs, stack)
            record = await asyncio.wait_for(told, 10)
        left = await list_keys(s3, "jobs", "shards/")
        results = await list_keys(s3, "jobs", "results/")
    assert [
        parse_message(m["Body"], bucket="jobs", input_prefix="incoming/")[0].key for m in dead
    ] == [f"incoming/huge{suffix}"]
    assert record is not None and "more than 3 shards" in record["rejected"]
    assert record["input"]["key"] == f"incoming/huge{suffix}"
    # Refused whole, nothing half-done left: its rejection record is all there is.
    assert left == [] and [k.endswith(".rejected.json") for k in results] == [True]
    assert sent == [] and [w for w in writes if w.startswith("shards/")] == []  # nothing first


async def test_submit_takes_no_earlier_runs_rejection_for_its_own(
    endpoint: str, tmp_path: Any
) -> None:
    """A rejection record older than the upload (an earlier run's) is not this job's answer."""
    settings = _settings(endpoint)
    job = tmp_path / "again.jsonl"
    job.write_bytes(_body(2))
    keys = output_keys(settings, "incoming/again.jsonl", hashlib.md5(_body(2)).hexdigest())
    async with aws_clients(endpoint) as (s3, sqs):
        await _stack(s3, sqs, settings)
        await s3.put_object(Bucket="jobs", Key=keys.rejected, Body=b'{"rejected": "old"}')
        await asyncio.sleep(1.1)  # S3's LastModified is to the second
        assert await submit(settings, job, timeout_s=1.5, progress=False) is None


async def _wait_dead(fleet: Fleet, sqs: Any, stack: dict[str, str]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    async def some() -> bool:
        found.extend(await receive_all(sqs, stack["dlq_url"], wait=0))
        return bool(found)

    await fleet.run_until(some, 30)
    return found


async def test_12_a_role_without_list_bucket_on_a_key_still_finishes_and_rejects_a_gone_input(
    endpoint: str,
) -> None:
    """S3 answers a missing key 403 to a role without s3:ListBucket (moto enforces no IAM; the
    proxy answers so): existence is asked by a listing, and a 403 on a read resolved by one."""
    settings = _settings(endpoint)
    forbid = Rule(lambda c: c.op in ("GetObject", "HeadObject"), "forbid_missing", times=10**6)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        job = await _drop(s3, settings, "incoming/iam.jsonl", _body(12))
        await s3.put_object(Bucket="jobs", Key="incoming/deleted.jsonl", Body=_body(2))
        await s3.delete_object(Bucket="jobs", Key="incoming/deleted.jsonl")
        async with Fleet(endpoint, settings, forbid, 2) as fleet:
            await fleet.run_until(_finished(s3, sqs, stack, settings, [job]), 60)
            dead = await _wait_dead(fleet, sqs, stack)  # taken off the DLQ: checked here
            rejected = sum(
                r.get_sample_value("arbiter_worker_jobs_total", {"outcome": "rejected"}) or 0
                for r in fleet.registries()
            )
        assert ["deleted.jsonl" in m["Body"] for m in dead] == [True] and rejected == 1
        bad = await violations(s3, sqs, stack, settings, [job])
    assert forbid.hits > 0
    assert bad == []


async def test_13_a_splitter_that_loses_the_manifest_to_one_that_dies_repairs_the_job(
    endpoint: str,
) -> None:
    """SQS delivers one message to a second worker while the first holds it (at-least-once); both
    split. The write that lands first is the second worker's, which dies right after it; the first
    loses the write and holds the only message: it must send the shards itself."""
    settings = _settings(endpoint)
    holder: list[int] = []

    def holds_the_job(call: Call) -> bool:
        held = call.held
        if held is not None and "race13" in held.body and not holder:
            holder.append(call.worker)
        return False

    redeliver = Rule(
        lambda c: c.op == "ReceiveMessage" and bool(holder) and c.worker != holder[0], "redeliver"
    )
    manifest = lambda c: c.op == "PutObject" and c.key.endswith("/manifest.json")  # noqa: E731
    delay = Rule(manifest, "delay")  # the first splitter's manifest write is slow...
    kill = Rule(lambda c: manifest(c) and delay.hits == 1, "kill_after")  # ...the second's lands

    def decide(call: Call) -> str:
        holds_the_job(call)
        return rules(redeliver, delay, kill)(call)

    bad, _, _ = await _run(endpoint, settings, decide, {"incoming/race13.jsonl": _body(12)})
    assert (redeliver.hits, delay.hits, kill.hits) == (1, 1, 1)
    assert bad == []


@pytest.mark.parametrize("lines", [3, 12])
async def test_14_no_multipart_upload_is_left_by_a_worker_killed_inside_one(
    endpoint: str, lines: int
) -> None:
    """Killed between CreateMultipartUpload and its completion, on the single path (3 lines) and
    the split one (12): uploads are aborted once the summary exists."""
    settings = _settings(endpoint, multipart_threshold_mb=0)
    kill = Rule(lambda c: c.op == "UploadPart", "kill_before", times=2)
    bad, _, _fleet = await _run(endpoint, settings, kill, {"incoming/parts.jsonl": _body(lines)})
    assert kill.hits == 2
    assert bad == []


# -- 15, 16 --------------------------------------------------------------------------------------


async def test_15_the_summary_names_every_model_that_scored_a_shard(endpoint: str) -> None:
    from tests.fakes import MODEL_INFO

    class Other(FakeEngine):
        model_info = MODEL_INFO.model_copy(update={"sha256": "1" * 64, "file": "other.gguf"})

    settings = _settings(endpoint)
    engines = lambda n: Other() if n == 1 else FakeEngine()  # noqa: E731 - a rolling update
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        job = await _drop(s3, settings, "incoming/models.jsonl", _body(40))
        async with Fleet(endpoint, settings, workers=2, engine=engines) as fleet:
            await fleet.run_until(_finished(s3, sqs, stack, settings, [job]), 60)
        keys = output_keys(settings, job.key, job.etag)
        summary = json.loads(await read_object(s3, "jobs", keys.summary))
    models = {m["sha256"]: m["shards"] for m in summary["models"]}
    assert set(models) == {"0" * 64, "1" * 64} and sum(models.values()) == 10


def test_16_fanout_messages_ignore_fields_they_do_not_know() -> None:
    body = {"arbiter_shard": 3, "bucket": "jobs", "key": "incoming/a.jsonl", "etag": "e"}
    body |= {"plan": "ab12" * 4, "index": 3, "count": 8, "priority": "high", "trace": {"id": 1}}
    [shard] = parse_message(json.dumps(body), bucket="jobs", input_prefix="incoming/")
    merge = {"arbiter_merge": 2, "bucket": "jobs", "key": "incoming/a.jsonl", "etag": "e"}
    merge |= {"plan": "ab12" * 4, "added_in_a_later_release": True}
    [merged] = parse_message(json.dumps(merge), bucket="jobs", input_prefix="incoming/")
    assert (shard.index, merged.plan) == (3, "ab12" * 4)  # type: ignore[union-attr]
