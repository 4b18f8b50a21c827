"""An application calling Arbiter the three ways SageMaker offers, with boto3 and nothing else.

The same file runs against `make run`'s stack and against AWS: which one is decided by the
environment alone (botocore's AWS_ENDPOINT_URL_<SERVICE> variables; see docs/sagemaker.md, "From
your application"). As on AWS an endpoint is real-time or async, not both: ENDPOINT names the
real-time one, ASYNC_ENDPOINT the async one, BUCKET the data bucket. With no arguments it runs
every way, each on its endpoint.
"""

import json
import os
import sys
import time

import boto3

ENDPOINT = os.environ.get("ENDPOINT", "arbiter")
ASYNC_ENDPOINT = os.environ.get("ASYNC_ENDPOINT", "arbiter-async")
BUCKET = os.environ.get("BUCKET", "arbiter-jobs")
runtime = boto3.client("sagemaker-runtime")
s3 = boto3.client("s3")
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "decisions.jsonl"), "rb") as f:
    lines = f.read()
first = json.loads(lines.splitlines()[0])


def real_time() -> None:
    """InvokeEndpoint: one decision, its probabilities in the answer."""
    got = runtime.invoke_endpoint(
        EndpointName=ENDPOINT, ContentType="application/json", Body=json.dumps({"decision": first})
    )
    result = json.loads(got["Body"].read())["result"]
    print(
        "invoke_endpoint:",
        result["choice"],
        dict(zip(result["option_ids"], result["probabilities"], strict=True)),
    )


def with_retries(body: bytes, attempts: int = 5) -> bytes:
    """A container 4xx/5xx reaches the caller as ModelError (424) with OriginalStatusCode; a 503
    (busy, model loading) is worth retrying, a 4xx is not."""
    for attempt in range(attempts):
        try:
            got = runtime.invoke_endpoint(
                EndpointName=ENDPOINT, ContentType="application/json", Body=body
            )
            return bytes(got["Body"].read())
        except runtime.exceptions.ModelError as error:
            if error.response["OriginalStatusCode"] != 503 or attempt == attempts - 1:
                raise
            time.sleep(2**attempt)
    raise AssertionError("unreachable")


def refused() -> None:
    try:
        with_retries(json.dumps({"decision": {**first, "options": []}}).encode())
    except runtime.exceptions.ModelError as error:
        status = error.response["OriginalStatusCode"]
        print("ModelError:", status, json.loads(error.response["OriginalMessage"])["error"]["code"])


def asynchronous() -> None:
    """InvokeEndpointAsync: the input in S3, then poll the OutputLocation (or the FailureLocation)."""
    s3.put_object(Bucket=BUCKET, Key="async/input/decisions.jsonl", Body=lines)
    queued = runtime.invoke_endpoint_async(
        EndpointName=ASYNC_ENDPOINT,
        ContentType="application/jsonlines",
        InputLocation=f"s3://{BUCKET}/async/input/decisions.jsonl",
    )
    for _ in range(600):
        for where in ("OutputLocation", "FailureLocation"):
            bucket, key = queued[where][5:].split("/", 1)
            try:
                body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            except s3.exceptions.NoSuchKey:
                continue
            records = [json.loads(line) for line in body.splitlines()]
            print(f"invoke_endpoint_async: {where}", len(records), "records")
            return
        time.sleep(1)
    sys.exit("no async result within 10 minutes")


def streamed() -> None:
    """InvokeEndpointWithResponseStream: JSON Lines records as they are scored. Parts are byte
    ranges, not lines: buffer until a newline."""
    got = runtime.invoke_endpoint_with_response_stream(
        EndpointName=ENDPOINT, ContentType="application/jsonlines", Body=lines
    )
    pending, count = b"", 0
    for event in got["Body"]:
        pending += event["PayloadPart"]["Bytes"]
        *complete, pending = pending.split(b"\n")
        count += len([line for line in complete if line.strip()])
    print("invoke_endpoint_with_response_stream:", count, "records")


if __name__ == "__main__":
    for way in sys.argv[1:] or ["real_time", "refused", "asynchronous", "streamed"]:
        globals()[way]()
