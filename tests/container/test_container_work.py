"""`IMAGE work` as the ECS task runs it, against moto's S3+SQS server on the host network."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from tests.aws import aws_clients, list_keys, read_object, wait_for
from tests.container.podman_support import STOP_GRACE_S, RunContainer, record
from tests.fakes import decision_line
from tests.ports import free_port
from worker.settings import WorkerSettings
from worker.stack import ensure_stack


def worker_env(endpoint: str) -> list[str]:
    env = {
        "ARBITER_AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "ARBITER_WAIT_TIME_S": "1",
        "ARBITER_METRICS_PORT": str(free_port()),
    }
    return [arg for name, value in env.items() for arg in ("--env", f"{name}={value}")]


async def test_work_processes_a_job_dropped_in_s3_and_stops_on_sigterm(
    endpoint: str, run_container: RunContainer
):
    """Read-only root filesystem and a tmpfs /tmp, as a hardened ECS task would run it."""
    settings = WorkerSettings()
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, settings)
        container = run_container(
            "--network", "host", "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp",
            *worker_env(endpoint),
            command=("work",),
        )  # fmt: skip
        container.wait_log('"worker.ready"')
        lines = [decision_line(i, state=f"Order {i} arrived broken.") for i in range(5)]
        body = gzip.compress(("\n".join(lines) + "\n").encode())
        await s3.put_object(Bucket=settings.bucket, Key="incoming/job-1.jsonl.gz", Body=body)

        async def summary_written() -> list[str]:
            keys = await list_keys(s3, settings.bucket, settings.output_prefix)
            return keys if any(k.endswith(".summary.json") for k in keys) else []

        keys = await wait_for(summary_written, within_s=180)
        [results_key] = [k for k in keys if k.endswith(".results.jsonl")]
        assert results_key.startswith("results/job-1.jsonl")
        raw = await read_object(s3, settings.bucket, results_key)
        records = [json.loads(line) for line in raw.decode().splitlines()]
        assert sorted(r["id"] for r in records) == [f"d{i}" for i in range(5)]
        for rec in records:
            assert "result" in rec, rec
            assert abs(sum(rec["result"]["probabilities"]) - 1.0) < 1e-6
    report = container.preflight()
    assert report["command"] == "work" and report["model_source"] == "bundled"

    code, took = container.stop()
    record("`podman stop` (SIGTERM) of work until exit", round(took, 2), "s")
    assert code == 0, container.logs()
    assert took < STOP_GRACE_S
    assert any(e.get("event") == "pool.stopped" for e in container.events()), container.logs()


def test_a_model_dir_that_cannot_be_written_is_one_clear_line(
    endpoint: str, run_container: RunContainer, tmp_path: Path
):
    """ECS with a read-only root: the archive named by ARBITER_MODEL_DATA_URL cannot be unpacked
    into /opt/ml/model. The entrypoint says so in one line and exits non-zero, no traceback."""
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    s3.create_bucket(Bucket="models")
    s3.put_object(Bucket="models", Key="m/model.tar.gz", Body=b"not read: the write fails first")
    container = run_container(
        "--network", "host", "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp",
        "--env", "ARBITER_MODEL_DATA_URL=s3://models/m/model.tar.gz",
        *worker_env(endpoint),
        command=("work",),
    )  # fmt: skip
    code = container.wait_exit()
    assert code != 0
    lines = [line for line in container.logs().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "arbiter entrypoint: refusing to start `work`: cannot use /opt/ml/model"
    )
    assert "Read-only file system" in lines[0]
