"""`arbiter bench all`: the letter readers and the report, without running the benchmarks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import all_bench


def test_letters_from_top_logprobs_combine_both_spellings() -> None:
    top = {"A": math.log(0.2), " A": math.log(0.1), " B": math.log(0.3), "The": math.log(0.4)}
    a, b, c = all_bench.letters_from_top_logprobs(top, 3)
    assert a == pytest.approx(math.log(0.3))
    assert b == pytest.approx(math.log(0.3))
    assert c == -math.inf  # not in the top 20


def test_parse_letter() -> None:
    assert all_bench.parse_letter(" B", 3) == 1
    assert all_bench.parse_letter("\n(C) because", 3) == 2
    assert all_bench.parse_letter(" D", 3) is None  # no such option
    assert all_bench.parse_letter("The answer", 3) is None


def test_available_suites_are_modules_here() -> None:
    suites = all_bench.available_suites()
    assert "engine" in suites
    assert set(suites) <= set(all_bench.SUITES)


def test_render_handles_skips_and_failures() -> None:
    pair = {
        "arbiter_p50_ms": 100.0,
        "arbiter_p95_ms": 150.0,
        "other_p50_ms": 250.0,
        "other_p95_ms": 400.0,
        "p50_ratio": 2.5,
        "p95_ratio": 2.67,
        "agreement": 0.75,
    }
    text = all_bench.render(
        {
            "machine": "2 CPUs",
            "n_gpu_layers": 0,
            "model": "m.gguf",
            "decisions": 4,
            "file": "x.jsonl",
            "suites": [
                {"suite": "engine", "ok": True, "seconds": 3.0, "summary": {"ratio": 1.02}},
                {"suite": "http", "ok": False, "seconds": 1.0, "error": "boom\nlast line"},
            ],
            "generation": {"skipped": "the engine has no generate method"},
            "llama_cpp_server": pair,
            "typed_gguf": "not installed: skipped",
        }
    )
    assert "| engine | yes | 3 | ratio=1.02 |" in text
    assert "| http | no | 1 | last line |" in text
    assert (
        "| llama-cpp-python server (logprobs) | 100 / 150 | 250 / 400 | 2.50x | 2.67x | 0.75 |"
        in text
    )
    assert "no generate method" in text


def test_update_readme_rewrites_only_the_generated_section(tmp_path: Path) -> None:
    from bench.all_bench import README_END, README_START, update_readme

    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nbefore\n\n{README_START}\nold\n{README_END}\n\nafter\n")
    update_readme(readme, "| a | b |", "arbiter bench all --limit 3")
    text = readme.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith(f"{README_END}\n\nafter\n")
    assert "old" not in text and "| a | b |" in text and "arbiter bench all --limit 3" in text
    (tmp_path / "bare.md").write_text("no markers\n")
    with pytest.raises(SystemExit):
        update_readme(tmp_path / "bare.md", "x", "y")


def test_the_generated_section_names_no_path_of_this_machine(tmp_path: Path) -> None:
    """The generated section (then in the README, now in docs/performance.md) showed
    /work/main/examples/labeled.jsonl and the command's /tmp output directory: paths of the machine
    that ran it. Now: relative to the repository, or the file name."""
    from arbiter.cli import build_parser
    from bench.common import LABELED, ROOT, shown

    assert shown(LABELED) == "examples/labeled.jsonl"
    assert shown(tmp_path / "mine.jsonl") == "mine.jsonl"
    argv = ["bench", "all", "--limit", "20", "--out", str(tmp_path / "out")]
    page = ROOT / "docs" / "performance.md"
    args = build_parser("bench").parse_args([*argv, "--readme", str(page)])
    assert all_bench._command(args) == "arbiter bench all --limit 20 --readme docs/performance.md"
    other = [*argv, "--file", str(tmp_path / "x.jsonl"), "--model", "/models/m.gguf"]
    args = build_parser("bench").parse_args([*other, "--readme", str(tmp_path / "R.md")])
    command = all_bench._command(args)
    assert command.endswith("--file x.jsonl --model m.gguf --readme R.md")
    assert str(tmp_path) not in command and "/" not in command
