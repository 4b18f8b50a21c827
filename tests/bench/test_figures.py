"""The checks every bench runs on its figures (bench/figures.py): a ratio below its physical floor
or above its ceiling, a spread wider than its effect and too few pairs are each flagged; a figure
that is possible and clear is not. And `--smoke`: every suite has sizes that its own parser takes,
so `make bench-smoke` cannot fall out of step with a suite's options."""

from __future__ import annotations

import argparse
import io

import pytest

from bench import cli
from bench.figures import Progress, Ratio, check, paired, verdict


def test_a_ratio_below_its_floor_is_flagged_and_one_above_it_is_not() -> None:
    steady = (0.58, 0.59, 0.6, 0.59)
    [line] = Ratio("single_150_vs_floor", 0.59, steady, floor=1.0).warnings()
    assert "0.590 is below its floor 1" in line
    assert Ratio("single_150_vs_floor", 1.03, (1.02, 1.03, 1.03, 1.04), floor=1.0).warnings() == []


def test_a_ratio_above_its_ceiling_is_flagged() -> None:
    [line] = Ratio("end_to_end_vs_engine", 4.9, (4.8, 4.9, 5.0), ceiling=1.0).warnings()
    assert "4.900 is above its ceiling 1" in line


def test_a_spread_wider_than_the_effect_is_flagged() -> None:
    noisy = Ratio("speedup", 1.1, (0.7, 0.9, 1.3, 1.6))
    [line] = noisy.warnings()
    assert "wider than its effect (0.100 from 1)" in line
    assert Ratio("speedup", 3.7, (3.5, 3.6, 3.8, 3.9)).warnings() == []


def test_too_few_pairs_are_flagged() -> None:
    [line] = Ratio("speedup", 3.0, (2.9, 3.1)).warnings()
    assert "2 pair(s), too few" in line


def test_paired_takes_the_medians_and_each_pairs_ratio() -> None:
    ratio = paired("x", [2.0, 4.0, 6.0], [1.0, 2.0, 2.0], floor=1.0)
    assert ratio.value == pytest.approx(2.0) and ratio.pairs == (2.0, 2.0, 3.0)
    stream = io.StringIO()
    assert check([ratio, Ratio("y", 0.5, (0.5, 0.5, 0.5), floor=1.0)], stream) == [
        Ratio("y", 0.5, (0.5, 0.5, 0.5), floor=1.0).warnings()[0]
    ]
    assert stream.getvalue().startswith("warning: y = 0.500 is below its floor")


def test_progress_says_what_and_how_long_at_most_every_so_often() -> None:
    stream = io.StringIO()
    progress = Progress("engine", every_s=60, stream=stream)
    progress("single decision: 0 of 6")
    progress("single decision: 1 of 6")  # within the minute: not printed
    progress("many options", always=True)
    lines = stream.getvalue().splitlines()
    assert [line.split("] ")[1] for line in lines] == ["single decision: 0 of 6", "many options"]
    assert lines[0].startswith("[bench engine 0 s]")


def test_a_smoke_run_judges_the_checks_but_not_the_targets() -> None:
    passes = {"chats_refused": True, "under_chats_ratio<=1.5": False}
    assert verdict(passes, {"under_chats_ratio<=1.5"}, smoke=True) == 0
    assert verdict(passes, {"under_chats_ratio<=1.5"}, smoke=False) == 1
    assert verdict({**passes, "chats_refused": False}, {"under_chats_ratio<=1.5"}, smoke=True) == 1


@pytest.mark.parametrize("suite", cli.SUITES)
def test_every_suite_has_smoke_sizes_its_own_parser_takes(suite: str) -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench", suite, "--smoke"])
    smoke = cli.module_of(suite).SMOKE
    assert smoke and set(smoke) <= set(vars(args)), set(smoke) - set(vars(args))
