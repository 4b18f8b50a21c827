"""`arbiter prompt FILE.jsonl`: what it prints is what the engine prefills (issue 20)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from arbiter.cli import main
from arbiter.engine import Engine
from arbiter.engine.rotation import ReadPolicy, canonical_requests
from arbiter.lines import parse_decision_line
from arbiter.schema import DecisionResult
from arbiter.show_prompt import cmd_prompt
from tests import EXAMPLES
from tests.fakes import decision_body


def _records(
    path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> list[dict[str, object]]:
    assert main(["prompt", str(path), "--json", "--model", str(model)]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("which", ["engine", "chat_engine"])
def test_each_prompt_is_the_one_the_engine_prefills_with_its_counts_and_sha256(
    which: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    eng: Engine = request.getfixturevalue(which)
    path = EXAMPLES / "decisions.jsonl"
    records = _records(path, eng.resolved.path, capsys)
    decisions = [
        parse_decision_line(line) for line in path.read_text().splitlines() if line.strip()
    ]
    eng.cache.clear()
    results = eng.score(decisions)  # one call, grouped by state as arbiter decide groups a chunk
    assert len(records) == len(results) == len(decisions) > 2
    # A decision read adaptively shows its first read: its options in their canonical order.
    first = canonical_requests(decisions, eng.read_policy(eng.settings))
    shown_reordered = 0
    for record, result, decision in zip(records, results, first, strict=True):
        assert isinstance(result, DecisionResult), result
        assert record["id"] == result.id
        assert record["text"] == eng.render_text(decision)
        assert record["tokens"] == len(eng.prompt_tokens(decision))
        suffix = record["tokens"] - record["prefix_tokens"]
        if result.orders_read == 1:
            assert record["tokens"] == result.prompt.input_tokens
        else:  # the later orders' suffixes: the same options in other orders, about as long
            assert result.prompt.input_tokens - record["tokens"] >= (result.orders_read - 1) * (
                suffix - 2 * len(decision.options)
            )
        assert record["prefix_tokens"] == result.prompt.prefix_tokens
        assert record["sha256"] == result.prompt.sha256
        assert record["version"] == result.prompt.version
        shown_reordered += (
            decision.options != next(d for d in decisions if d.id == decision.id).options
        )
    assert shown_reordered > 0  # the example file lists some options out of their canonical order
    assert len({r["prefix_tokens"] for r in records}) < len(records)  # shared states share it


def test_a_bad_line_is_its_error_beside_the_others(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps(decision_body("ok")),
        "{not json",
        json.dumps(decision_body("many", options=256)),
        json.dumps({**decision_body("blank"), "question": " "}),
    ]
    path.write_text("\n".join(lines) + "\n")
    records = _records(path, engine.resolved.path, capsys)
    assert [r.get("id") for r in records] == ["ok", None, "many", "blank"]
    assert "text" in records[0]
    codes = [r["error"]["code"] for r in records[1:]]  # type: ignore[index]
    assert codes == ["invalid_json", "too_many_options", "invalid_field"]


def test_the_text_form_names_the_counts_and_prints_the_prompt(
    engine: Engine, tmp_path: Path
) -> None:
    import argparse

    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(decision_body("d1")) + "\n")
    out = io.StringIO()
    args = argparse.Namespace(
        file=str(path), model=engine.resolved.path, chunk=64, json=False, profile=None
    )
    assert cmd_prompt(args, out) == 0
    # What it prints is the first read: the options in their canonical order, read once.
    given = parse_decision_line(path.read_text())
    request = canonical_requests([given], ReadPolicy())[0].model_copy(update={"order_samples": 1})
    result = engine.score([request])[0]
    assert isinstance(result, DecisionResult)
    printed = out.getvalue()
    assert printed.startswith(
        f"### line 1 id=d1: {result.prompt.input_tokens} tokens, "
        f"{result.prompt.prefix_tokens} prefilled once for its state"
    )
    assert engine.render_text(request) in printed


# -- issue 28: a line it cannot build gets the engine's error; a file profile has its own version --


def test_more_options_than_a_profiles_labels_is_the_engines_error_not_a_crash(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The docs' yes/no profile and a three-option decision: `arbiter decide` refuses the line
    (too_many_options); `arbiter prompt` raised AssertionError (and ValueError from zip() for
    code labels). Each line is now the engine's own outcome."""
    from tests.arbiter.test_profiles import YES_NO

    profiles = {
        "yes-no": YES_NO,
        "codes": YES_NO.replace('labels = ["yes", "no"]', 'labels = ["Q7", "R8"]'),
    }
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        json.dumps(decision_body("three", options=3))
        + "\n"
        + json.dumps(decision_body("two", options=2))
        + "\n"
    )
    for name, text in profiles.items():
        profile = tmp_path / f"{name}.toml"
        profile.write_text(text)
        argv = ["prompt", str(path), "--json", "--model", str(engine.resolved.path)]
        assert main([*argv, "--profile", str(profile)]) == 0, name
        three, two = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert three["error"]["code"] == "too_many_options", name
        assert "label at most 2 options" in three["error"]["message"]
        assert ("- Q7: " if name == "codes" else "- yes: ") in two["text"], name


def test_a_decision_too_long_for_the_context_is_the_engines_error(
    engine: Engine,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(decision_body("long", state="word " * 4000)) + "\n")
    monkeypatch.setenv("ARBITER_N_CTX", "1024")
    assert main(["prompt", str(path), "--json", "--model", str(engine.resolved.path)]) == 1
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["error"]["code"] == "context_length_exceeded"
    assert record["error"]["param"] == "state"


def test_a_profile_file_named_like_a_builtin_reports_its_own_version(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import hashlib

    from arbiter.profiles import builtin_bytes

    text = builtin_bytes("arbiter-letters-v1").decode().replace("Answer", "Reply", 1)
    impostor = tmp_path / "arbiter-letters-v1.toml"
    impostor.write_text(text)
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(decision_body("d1")) + "\n")
    argv = ["prompt", str(path), "--json", "--model", str(engine.resolved.path)]
    assert main(argv) == 0
    (builtin,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main([*argv, "--profile", str(impostor)]) == 0
    (own,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    sha = hashlib.sha256(text.encode()).hexdigest()
    assert builtin["version"] == "arbiter-letters-v1/plain"
    assert own["version"] == f"arbiter-letters-v1@{sha[:12]}/plain"


def test_a_line_that_is_not_utf8_is_its_error_and_the_others_print(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Latin-1 line gave a UnicodeDecodeError traceback and no output at all (issue 35); over
    HTTP and in a job the same line is one invalid_json record."""
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(decision_body("ok")).encode()
    latin1 = json.dumps(decision_body("caf\u00e9"), ensure_ascii=False).encode("latin-1")
    path.write_bytes(good + b"\n" + latin1 + b"\n" + good.replace(b'"ok"', b'"after"') + b"\n")
    records = _records(path, engine.resolved.path, capsys)
    assert [r["line"] for r in records] == [1, 2, 3]
    assert [r.get("id") for r in records] == ["ok", None, "after"]
    error = records[1]["error"]
    assert isinstance(error, dict) and error["code"] == "invalid_json"
    assert "UTF-8" in error["message"]


@pytest.mark.parametrize("command", ["prompt", "decide"])
@pytest.mark.parametrize("chunk", ["0", "-1", "x"])
def test_chunk_must_be_a_positive_count(
    command: str, chunk: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--chunk 0`` was a traceback and ``--chunk -1`` printed nothing and exited 0."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(decision_body("d1")) + "\n")
    with pytest.raises(SystemExit) as exited:
        main([command, str(path), f"--chunk={chunk}"])
    assert exited.value.code == 2
    assert "--chunk: must be a positive number of lines" in capsys.readouterr().err
