"""Prompt profiles (issue 20): a TOML file sets the instruction, the layout, the labels and the
answer cue; the built-in one is today's prompt; a bad one stops start-up with one clear line."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from arbiter.engine import Engine, open_engine
from arbiter.engine.probabilities import logsumexp
from arbiter.engine.prompting import check_prompts
from arbiter.errors import LabelVocabularyError, ManifestMismatch, ModelLoadError, TooManyOptions
from arbiter.models import MANIFEST_NAME, sha256_file
from arbiter.profiles import builtin_bytes, load_profile
from arbiter.schema import DecisionResult
from arbiter.settings import EngineSettings
from tests.fakes import decision
from tests.threads import TEST_THREADS

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
# The base model was never trained on these profiles' labels: the read check at load would refuse
# it (its probes' label mass is under the threshold); these tests are about the profiles' mechanics.
WARN = "warn"
URGENT = decision(
    "urgent",
    "Since this morning none of our 420 users can sign in with SSO.",
    "Is this ticket urgent?",
    [("urgent", "It is urgent"), ("routine", "It can wait")],
)


def _ok(outcome: object) -> DecisionResult:
    assert isinstance(outcome, DecisionResult), outcome
    return outcome


def _write(tmp_path: Path, text: str, name: str = "profile.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def yes_no_engine(default_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = _write(tmp_path_factory.mktemp("profile"), YES_NO)
    eng = open_engine(
        EngineSettings(
            model=default_gguf,
            n_threads=TEST_THREADS,
            n_ctx=2048,
            prompt_profile=str(path),
            read_check=WARN,
        )
    )
    yield eng
    eng.close()


def test_the_builtin_profile_is_reported_with_the_sha256_of_its_file(engine: Engine) -> None:
    result = _ok(engine.score([URGENT])[0])
    expected = hashlib.sha256(builtin_bytes("arbiter-letters-v1")).hexdigest()
    assert result.prompt.profile == "arbiter-letters-v1"
    assert result.prompt.profile_sha256 == expected
    assert result.model.prompt_profile_sha256 == expected
    assert result.prompt.version == "arbiter-letters-v1/plain"


def test_a_profile_sets_the_instruction_layout_labels_and_cue(yes_no_engine: Engine) -> None:
    text = yes_no_engine.render_text(URGENT)
    assert text == (
        "Answer the question about the ticket with yes or no.\n\n"
        "Ticket:\nSince this morning none of our 420 users can sign in with SSO.\n\n"
        "Is this ticket urgent?\n- yes: It is urgent\n- no: It can wait\nAnswer:"
    )
    result = _ok(yes_no_engine.score([URGENT])[0])
    # A file's profile reports its own sha256 in the version (never a built-in's name alone).
    sha = hashlib.sha256(YES_NO.encode()).hexdigest()
    assert result.prompt.version == f"ticket-yes-no-v1@{sha[:12]}/plain"
    assert result.prompt.profile == "ticket-yes-no-v1"
    assert result.prompt.profile_sha256 == hashlib.sha256(YES_NO.encode()).hexdigest()
    assert sum(result.probabilities) == pytest.approx(1.0)
    # The option logits are the labels' own tokens at the last position (" yes" and "yes").
    llama, labels = yes_no_engine.llama, yes_no_engine.labels
    assert [llama.vocab.piece_text(int(t)).strip() for t in labels.token_ids[:, 0]] == ["yes", "no"]
    tokens = yes_no_engine.prompt_tokens(URGENT)
    prefix = result.prompt.prefix_tokens
    with yes_no_engine.session():
        llama.prefill(tokens[:prefix])
        row = llama.last_logits(tokens[prefix:], prefix)
    expected = logsumexp(row[labels.token_ids[:2]], axis=1)
    assert np.allclose(result.option_logits, expected, atol=1e-3)


def test_more_options_than_the_profile_has_labels_is_refused_on_its_own(
    yes_no_engine: Engine,
) -> None:
    three = decision("three", "state", "Which?", [("a", "A"), ("b", "B"), ("c", "C")])
    outcomes = yes_no_engine.score([three, URGENT])
    assert isinstance(outcomes[0], TooManyOptions)
    assert "label at most 2 options" in outcomes[0].message
    _ok(outcomes[1])


def test_two_token_labels_are_read_by_the_chain_rule(default_gguf: Path, tmp_path: Path) -> None:
    profile = YES_NO.replace('labels = ["yes", "no"]', 'labels = ["Q7", "R8", "S9"]').replace(
        "ticket-yes-no-v1", "ticket-codes-v1"
    )
    path = _write(tmp_path, profile)
    eng = open_engine(
        EngineSettings(
            model=default_gguf,
            n_threads=TEST_THREADS,
            n_ctx=2048,
            prompt_profile=str(path),
            read_check=WARN,
        )
    )
    try:
        assert eng.labels.max_letters == 0 and eng.labels.codes is not None
        three = decision("three", "A state.", "Which one?", [("a", "A"), ("b", "B"), ("c", "C")])
        result = _ok(eng.score([three])[0])
        assert "- Q7: A\n- R8: B\n- S9: C\n" in eng.render_text(three)
        sha = hashlib.sha256(profile.encode()).hexdigest()
        assert result.prompt.version == f"ticket-codes-v1-codes@{sha[:12]}/plain"
        assert sum(result.probabilities) == pytest.approx(1.0)
        assert 0 < result.allowed_mass <= 1
        assert all(x <= 0 for x in result.option_logits)  # chain-rule log-probabilities
    finally:
        eng.close()


def test_a_digits_profile_labels_up_to_nine_options(default_gguf: Path, tmp_path: Path) -> None:
    path = _write(tmp_path, YES_NO.replace('labels = ["yes", "no"]', 'labels = "digits"'))
    prompts = check_prompts(default_gguf, EngineSettings(), load_profile(path))
    assert prompts.labels.texts(3) == ["1", "2", "3"] and prompts.labels.max_options == 9


BAD_PROFILES = [
    ("format = 2", lambda t: t.replace("format = 1", "format = 2"), "format"),
    ("not TOML", lambda t: t.replace("format = 1", "format = "), "is not valid TOML"),
    ("unknown key", lambda t: t + "\nlabel_set = 1\n", "label_set: Extra inputs"),
    ("no state", lambda t: t.replace("{{ state }}", "the state"), "state must place"),
    ("a typo", lambda t: t.replace("{{ question }}", "{{ questoin }}"), "'questoin' is undefined"),
    ("bad syntax", lambda t: t.replace("{% endfor %}", ""), "question: Value error, not a valid"),
    ("no option text", lambda t: t.replace(": {{ option.text }}", ""), "each option's text"),
    (
        "sandbox",
        lambda t: t.replace("{{ question }}", "{{ question.__class__.__mro__ }}"),
        "unsafe",
    ),
    (
        "fails past two options",  # it passed the probe of two, then failed each larger decision
        lambda t: t.replace('["yes", "no"]', '["yes", "no", "maybe"]').replace(
            "{% endfor %}", "{% endfor %}{% if options | length > 2 %}{{ extra }}{% endif %}"
        ),
        "does not render 3 options: UndefinedError: 'extra' is undefined",
    ),
    (
        "fails on codes",
        lambda t: t.replace('["yes", "no"]', '"letters"').replace(
            "{% endfor %}", "{% endfor %}{% if codes %}{{ oops }}{% endif %}"
        ),
        "does not render 27 options",
    ),
    ("one label", lambda t: t.replace('["yes", "no"]', '["yes"]'), "2 to 255 labels"),
    ("same labels", lambda t: t.replace('["yes", "no"]', '["yes", "yes"]'), "distinct"),
]


@pytest.mark.parametrize(("_", "mutate", "needle"), BAD_PROFILES, ids=[b[0] for b in BAD_PROFILES])
def test_a_bad_profile_is_refused_with_one_line_that_names_it(
    tmp_path: Path, _: str, mutate: object, needle: str
) -> None:
    path = _write(tmp_path, mutate(YES_NO))  # type: ignore[operator]
    with pytest.raises(ModelLoadError) as refused:
        load_profile(path)
    message = refused.value.message
    assert needle in message and str(path) in message and "\n" not in message


def test_labels_that_do_not_tokenize_soundly_are_refused_naming_the_label(
    default_gguf: Path, tmp_path: Path
) -> None:
    long = "supercalifragilisticexpialidocious"
    path = _write(tmp_path, YES_NO.replace('["yes", "no"]', f'["yes", "{long}"]'))
    with pytest.raises(LabelVocabularyError) as refused:
        check_prompts(default_gguf, EngineSettings(), load_profile(path))
    assert f"label '{long}' is " in refused.value.message
    assert "refusing to start" in refused.value.message


def test_a_missing_profile_names_the_setting_and_the_built_ins(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="arbiter-letters-v1"):
        load_profile(tmp_path / "nope.toml")


# -- served from a model dir: the manifest packs the profile ------------------------------------


def _model_dir(tmp_path: Path, gguf: Path, profile: str, sha256: str | None = None) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / gguf.name).symlink_to(gguf)
    (directory / "profile.toml").write_text(profile)
    manifest = {
        "gguf": {"file": gguf.name, "sha256": sha256_file(gguf)},
        "profile": {
            "file": "profile.toml",
            "sha256": sha256 or hashlib.sha256(profile.encode()).hexdigest(),
        },
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    return directory


@pytest.mark.real_model
def test_a_model_dirs_manifest_serves_its_profile_and_refuses_a_changed_one(
    default_gguf: Path, tmp_path: Path
) -> None:
    directory = _model_dir(tmp_path, default_gguf, YES_NO)
    eng = open_engine(
        EngineSettings(model_dir=directory, n_threads=TEST_THREADS, n_ctx=1024, read_check=WARN)
    )
    try:
        result = _ok(eng.score([URGENT])[0])
        assert result.prompt.profile == "ticket-yes-no-v1"
        assert result.prompt.profile_sha256 == hashlib.sha256(YES_NO.encode()).hexdigest()
    finally:
        eng.close()
    (directory / "profile.toml").write_text(YES_NO.replace("yes or no", "yes or no!"))
    with pytest.raises(ManifestMismatch, match="prompt profile is corrupt"):
        open_engine(
            EngineSettings(model_dir=directory, n_threads=TEST_THREADS, n_ctx=1024, read_check=WARN)
        )


def test_the_setting_wins_over_the_manifest(default_gguf: Path, tmp_path: Path) -> None:
    directory = _model_dir(tmp_path, default_gguf, YES_NO)
    settings = EngineSettings(model_dir=directory, prompt_profile="arbiter-letters-v1")
    from arbiter.models import resolve_model
    from arbiter.profiles import resolve_profile

    assert resolve_profile(settings.prompt_profile, resolve_model(None, directory)).name == (
        "arbiter-letters-v1"
    )
    assert resolve_profile(None, resolve_model(None, directory)).name == "ticket-yes-no-v1"
