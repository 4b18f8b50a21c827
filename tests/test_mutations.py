"""`make mutate` undoes each named fix; a merge that rewrites the fixed line or renames its test
makes that mutation GONE or BROKEN, which only CI's later `make mutate` used to notice. Checked
here, in `make test`, from the text alone (nothing is mutated)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Protocol

import pytest

ROOT = Path(__file__).resolve().parent.parent


class Mutation(Protocol):
    name: str
    path: str
    fix: str
    tests: tuple[str, ...]


def _mutations() -> tuple[Mutation, ...]:
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutate", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return tuple(module.MUTATIONS)


MUTATIONS = _mutations()


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_fix_is_in_its_file_once_and_its_tests_exist(mutation: Mutation) -> None:
    found = (ROOT / mutation.path).read_text().count(mutation.fix)
    assert found == 1, f"{mutation.name}: its fix is in {mutation.path} {found} times"
    for node in mutation.tests:
        path, _, name = node.partition("::")
        source = (ROOT / path).read_text()  # a whole file is a target too
        if not name:
            continue
        function = re.sub(r"\[.*\]$", "", name.split("::")[-1])
        assert re.search(rf"def {re.escape(function)}\(", source), f"{mutation.name}: no {node}"


def test_names_are_unique() -> None:
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))


def test_a_mutation_file_with_a_key_the_runner_does_not_know_is_refused(tmp_path: Path) -> None:
    # A misspelt `tests` would leave a mutation that runs nothing: refused, not ignored.
    module = sys.modules["mutate"]
    folder = tmp_path / "tests" / "pkg"
    folder.mkdir(parents=True)
    (folder / "mutations.toml").write_text(
        "[[mutation]]\nname = 'x'\npath = 'a.py'\nfix = 'a'\nwithout = 'b'\ntest = ['t']\n"
    )
    with pytest.raises(SystemExit, match="unknown"):
        module.load(tmp_path)


def test_every_package_with_mutations_keeps_them_beside_its_tests() -> None:
    files = sorted(ROOT.glob("tests/*/mutations.toml"))
    assert len(files) >= 5
    assert len(MUTATIONS) >= 180  # the tuple's 186 moved here, none lost
