"""The project's documents and its built wheel, for the tests that run what the documents show.

`tests/test_documented_commands.py` runs every `arbiter` command line they name; and
`tests/test_documented_examples.py` runs their shell and Python blocks against a local stack. Both
run from the project's wheel: built from the working tree's files (tracked and
untracked-but-not-ignored, as a commit would have them) and installed into a fresh virtual
environment with no pip, no editable finder and no checkout on its path; the dev environment's
site-packages lends the installed dependencies through a ``.pth`` line (so nothing is downloaded),
and every command runs with its working directory outside the checkout. conftest's ``installed``
fixture builds it once per session.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests import ROOT
from tests.environ import environ_without

DOCUMENTS = ("README.md", "docs/*.md")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE = re.compile(r"(`+)(.+?)\1", re.S)


def documents() -> list[Path]:
    return sorted({p for pattern in DOCUMENTS for p in ROOT.glob(pattern)})


def code(text: str) -> Iterator[str]:
    """The documents' code: fenced blocks, then the inline spans of the rest."""
    for block in FENCE.finditer(text):
        yield block.group(0)
    for span in _INLINE.finditer(FENCE.sub("", text)):
        yield span.group(2)


@dataclass(frozen=True)
class Installed:
    """The wheel's environment: its interpreter, its ``arbiter`` script, a directory outside the
    checkout to run in, and the environment to run with."""

    python: Path
    arbiter: Path
    cwd: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.arbiter), *args],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _working_tree_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def _build_wheel(work: Path) -> Path:
    source = work / "source"
    for name in _working_tree_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    dist = work / "dist"
    options = ["-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist)]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", *options, str(source)],
        check=True,
        capture_output=True,
    )
    [wheel] = dist.glob("arbiter-*.whl")
    return wheel


def _isolated_env(venv: Path) -> dict[str, str]:
    """The caller's environment without anything that would point back at the checkout or set the
    engine up differently (ARBITER_*, SageMaker's SM_*, PYTHON*)."""
    env = environ_without("ARBITER_", "SM_", "PYTHON", "VIRTUAL_ENV")
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "/usr/bin:/bin")])
    env["VIRTUAL_ENV"] = str(venv)
    return env


def install(work: Path) -> Installed:
    """The working tree's wheel, built and installed in a fresh environment under ``work``."""
    wheel = _build_wheel(work)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    options = ["-q", "--no-deps", "--no-index", "--no-compile"]
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", *options, str(wheel)],
        check=True,
        capture_output=True,
    )
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # The dependencies, lent: a path line in a .pth puts the directory on sys.path, but the .pth
    # files inside it (the editable install's finder among them) are not run.
    lent = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "zz_lent_dependencies.pth").write_text("".join(f"{p}\n" for p in lent))
    cwd = work / "run"
    cwd.mkdir()
    env = _isolated_env(venv)
    where = subprocess.run(
        [str(python), "-c", "import arbiter, sys; print(arbiter.__file__)"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(venv), f"arbiter came from {where}, not the wheel"
    return Installed(python, venv / "bin" / "arbiter", cwd, env)
