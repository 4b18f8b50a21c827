"""The local endpoint is the serving template's, evaluated: what serving.yaml and data.yaml say is
what the front does, and a change to them changes it."""

from __future__ import annotations

from typing import Any

import pytest

from emulator import template
from emulator.template import TemplateError, endpoint_spec
from infra.deploy import Template, load_template


def test_the_spec_is_what_the_templates_deploy() -> None:
    spec = endpoint_spec(bucket="my-bucket", max_in_flight=None)
    serving = template.parse(load_template("serving.yaml").body)
    default = serving["Parameters"]["MaxInFlight"]["Default"]
    assert spec.variant == "AllTraffic"
    assert spec.asynchronous.max_concurrent == default
    assert spec.container_environment["ARBITER_MAX_IN_FLIGHT"] == str(default)
    assert spec.asynchronous.output_path == "s3://my-bucket/async/output/"
    assert spec.asynchronous.failure_path == "s3://my-bucket/async/failures/"
    assert spec.asynchronous.success_topic == (
        "arn:aws:sns:us-east-1:123456789012:arbiter-data-AsyncSuccessTopic"
    )
    assert set(spec.topics.values()) == {
        "arbiter-data-AsyncSuccessTopic",
        "arbiter-data-AsyncErrorTopic",
    }


def test_max_in_flight_is_both_the_containers_bound_and_the_async_concurrency() -> None:
    spec = endpoint_spec(bucket="b-1", max_in_flight=3, stack="other", region="eu-west-1")
    assert spec.asynchronous.max_concurrent == 3
    assert spec.container_environment["ARBITER_MAX_IN_FLIGHT"] == "3"
    assert spec.asynchronous.error_topic == (
        "arn:aws:sns:eu-west-1:123456789012:other-data-AsyncErrorTopic"
    )


def test_the_sagemaker_role_may_write_exactly_where_the_front_writes() -> None:
    serving = template.parse(load_template("serving.yaml").body)
    [policy] = serving["Resources"]["SageMakerRole"]["Properties"]["Policies"]
    [write] = [s for s in policy["PolicyDocument"]["Statement"] if s["Sid"] == "WriteAsyncResults"]
    prefixes = {r["Fn::Sub"][0].split("}/", 1)[1] for r in write["Resource"]}
    spec = endpoint_spec(bucket="b-2", max_in_flight=None)
    assert prefixes == {
        spec.asynchronous.output_path.removeprefix("s3://b-2/") + "*",
        str(spec.asynchronous.failure_path).removeprefix("s3://b-2/") + "*",
    }


def _edited(monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    def load(name: str) -> Template:
        found = load_template(name)
        return Template(name, found.body.replace(old, new)) if name == "serving.yaml" else found

    monkeypatch.setattr(template, "load_template", load)


def test_an_edited_template_changes_the_local_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    _edited(monkeypatch, '"s3://${Bucket}/async/output/"', '"s3://${Bucket}/answers/"')
    assert endpoint_spec(bucket="b-3", max_in_flight=None).asynchronous.output_path == (
        "s3://b-3/answers/"
    )


def test_an_intrinsic_the_evaluator_does_not_model_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _edited(
        monkeypatch,
        "MaxConcurrentInvocationsPerInstance: !Ref MaxInFlight",
        "MaxConcurrentInvocationsPerInstance: !FindInMap [Sizes, !Ref MaxInFlight, x]",
    )
    with pytest.raises(TemplateError, match="FindInMap"):
        endpoint_spec(bucket="b-4", max_in_flight=None)


def test_short_form_intrinsics_parse_as_their_long_forms() -> None:
    parsed: dict[str, Any] = template.parse(
        "A: !Ref X\nB: !GetAtt R.Arn\nC: !Sub ['${a}', {a: 1}]\nD: !If [C, 1, 2]\n"
    )
    assert parsed == {
        "A": {"Ref": "X"},
        "B": {"Fn::GetAtt": ["R", "Arn"]},
        "C": {"Fn::Sub": ["${a}", {"a": 1}]},
        "D": {"Fn::If": ["C", 1, 2]},
    }


def test_a_real_time_endpoint_is_the_templates_realtime_config() -> None:
    spec = endpoint_spec(bucket="b-5", max_in_flight=None, mode="realtime")
    assert spec.mode == "realtime" and spec.asynchronous is None
    assert spec.variant == "AllTraffic"  # RealtimeEndpointConfig's VariantName
    with pytest.raises(TemplateError):
        endpoint_spec(bucket="b-5", max_in_flight=None, mode="none")
