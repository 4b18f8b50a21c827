"""The documented application (examples/sagemaker_app.py, quoted in docs/sagemaker.md) runs unchanged
against the local stack: only the environment points boto3 at it, as it would point it at AWS."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from tests import EXAMPLES, ROOT
from tests.emulator.support import container, front, make_bucket

pytestmark = [pytest.mark.timeout(300), pytest.mark.real_model]


def test_the_readme_application_runs_unchanged_against_the_local_stack(
    engine: Any, endpoint: str
) -> None:
    make_bucket(endpoint)
    with container(engine) as url, front(url, endpoint) as api:
        env = {
            **os.environ,
            "AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME": api,
            "AWS_ENDPOINT_URL_S3": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        # As the README runs it, with no arguments: every way, each on its endpoint (as on AWS,
        # the real-time ones on `arbiter` and the async one on `arbiter-async`). It used to call
        # the async operation on the real-time endpoint, a traceback.
        ran = subprocess.run(
            [sys.executable, str(EXAMPLES / "sagemaker_app.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            cwd=ROOT,
        )
        assert ran.returncode == 0, ran.stderr
        out = ran.stdout.splitlines()
    assert out[0].startswith("invoke_endpoint: ")
    assert out[1] == "ModelError: 422 invalid_decision" or out[1].startswith("ModelError: 422 ")
    assert out[2] == "invoke_endpoint_async: OutputLocation 8 records"
    assert out[3] == "invoke_endpoint_with_response_stream: 8 records"


def test_the_docs_quote_the_application() -> None:
    page = (ROOT / "docs" / "sagemaker.md").read_text()
    section = page.split("## From your application", 1)[1].split("\n## ", 1)[0]
    code = (EXAMPLES / "sagemaker_app.py").read_text()
    for function in ("def real_time", "def with_retries", "def asynchronous", "def streamed"):
        start = code.index(function)
        block = code[start : code.index("\n\n\n", start)]
        assert block in section, f"docs/sagemaker.md's copy of {function} differs from the example"
