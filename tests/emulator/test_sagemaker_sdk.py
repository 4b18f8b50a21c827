"""The SageMaker Python SDK (v2: the line that has ``Predictor`` and ``AsyncPredictor``) against
`arbiter runtime`, configured as an application would for any AWS endpoint: botocore's
``AWS_ENDPOINT_URL_<SERVICE>`` variables, no code change."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from tests.emulator.support import BUCKET, container, front, make_bucket
from tests.fakes import decision_body

pytestmark = [pytest.mark.timeout(180), pytest.mark.real_model]


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("SAGEMAKER_SUPPRESS_V2_WARNING", "1")  # v2 warns that v3 exists
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    return importlib.import_module("sagemaker")


def session(sdk: Any, monkeypatch: pytest.MonkeyPatch, api: str, moto: str) -> Any:
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", api)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto)
    return sdk.Session(boto_session=boto3.Session(region_name="us-east-1"), default_bucket=BUCKET)


def test_predictor_predicts_through_invoke_endpoint(
    sdk: Any, engine: Any, endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sagemaker.deserializers import JSONDeserializer
    from sagemaker.predictor import Predictor
    from sagemaker.serializers import JSONSerializer

    with container(engine) as url, front(url, endpoint) as api:
        predictor = Predictor(
            "arbiter",
            sagemaker_session=session(sdk, monkeypatch, api, endpoint),
            serializer=JSONSerializer(),
            deserializer=JSONDeserializer(),
        )
        got = predictor.predict({"decision": decision_body("sdk-1")})
    assert got["result"]["id"] == "sdk-1"
    assert got["result"]["choice"] in {"access", "billing"}


def test_async_predictor_uploads_waits_and_reads_the_output(
    sdk: Any, engine: Any, endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sagemaker.async_inference import WaiterConfig
    from sagemaker.deserializers import JSONLinesDeserializer
    from sagemaker.predictor import Predictor
    from sagemaker.predictor_async import AsyncPredictor
    from sagemaker.serializers import JSONLinesSerializer

    make_bucket(endpoint)
    with container(engine) as url, front(url, endpoint) as api:
        predictor = Predictor(
            "arbiter-async",
            sagemaker_session=session(sdk, monkeypatch, api, endpoint),
            serializer=JSONLinesSerializer(),
            deserializer=JSONLinesDeserializer(),
        )
        waiting = AsyncPredictor(predictor).predict_async(
            data=[decision_body("a"), decision_body("b")],
            # The SDK's default upload prefix (async-endpoint-inputs/) is not what the endpoint's
            # role may read (serving.yaml grants async/input/*): on AWS it is AccessDenied, here too.
            input_path=f"s3://{BUCKET}/async/input/sdk-ab.jsonl",
            # The SDK sends no ContentType of its own for async calls (SageMaker would then pass
            # the container none either): the application names it, here as on AWS.
            initial_args={"ContentType": "application/jsonlines"},
        )
        records = waiting.get_result(WaiterConfig(max_attempts=60, delay=1))
    assert waiting.output_path.startswith(f"s3://{BUCKET}/async/output/")
    assert [r["id"] for r in records] == ["a", "b"]
