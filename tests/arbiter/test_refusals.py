"""The one line a refusal gets (arbiter/refusals.py), and what stays a bug."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
from pydantic import BaseModel, ValidationError

from arbiter.errors import ModelLoadError
from arbiter.refusals import refusal
from arbiter.settings import EngineSettings


def test_the_projects_own_errors_are_one_line() -> None:
    assert refusal(ModelLoadError("the model\n  is missing")) == "the model is missing"


def test_a_setting_that_does_not_validate_names_its_environment_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ARBITER_N_THREADS", "many")
    with pytest.raises(ValidationError) as caught:
        EngineSettings()
    line = refusal(caught.value)
    assert line is not None and line.startswith("invalid setting ARBITER_N_THREADS='many': ")
    assert "\n" not in line


def test_another_models_validation_error_is_a_bug() -> None:
    class Internal(BaseModel):
        n: int

    with pytest.raises(ValidationError) as caught:
        Internal.model_validate({"n": "x"})
    assert refusal(caught.value) is None


def test_aws_credentials_and_connections_are_refusals_other_client_errors_are_not() -> None:
    assert "AWS_ACCESS_KEY_ID" in str(refusal(NoCredentialsError()))
    unreachable = refusal(EndpointConnectionError(endpoint_url="http://127.0.0.1:9"))
    assert unreachable is not None and "ARBITER_AWS_ENDPOINT_URL" in unreachable
    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "PutObject")
    assert refusal(denied) == (
        "AWS refused PutObject: AccessDenied: no (check the credentials and their permissions)"
    )
    ours = ClientError({"Error": {"Code": "InvalidParameterValue", "Message": "x"}}, "SendMessage")
    assert refusal(ours) is None


def test_a_missing_file_is_a_refusal_a_group_only_when_all_of_it_is() -> None:
    missing = FileNotFoundError(2, "No such file or directory", "jobs.jsonl")
    assert refusal(missing) == "jobs.jsonl: No such file or directory"
    assert refusal(FileNotFoundError("no filename")) is None
    assert refusal(ExceptionGroup("g", [missing, NoCredentialsError()])) is not None
    assert refusal(ExceptionGroup("g", [missing, RuntimeError("bug")])) is None
    assert refusal(RuntimeError("bug")) is None
