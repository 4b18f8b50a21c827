"""The Python packages the device image lacks, as wheels that travel, and the one way to install them.

Versions are the ones this checkout's environment resolved (``make setup``), so the device runs the
engine on the same pydantic, structlog and so on as the tests here. pydantic-core is compiled per
CPython version: its wheel travels for each of ``plan.CORE_PYTHONS`` and :func:`select` takes the
one that matches the interpreter at hand. Downloads are cached under ``~/.cache/arbiter``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from gpucheck import plan


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _download(name: str, version: str, python: tuple[int, int], dest: Path) -> None:
    platforms = [arg for p in plan.MANYLINUX for arg in ("--platform", p)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            f"{python[0]}.{python[1]}",
            "--implementation",
            "cp",
            *platforms,
            "--dest",
            str(dest),
            f"{name}=={version}",
        ],
        check=True,
    )


def _cached(cache: Path, name: str, version: str, tag: str | None) -> Path | None:
    found = sorted(cache.glob(f"{_normal(name)}-{version}-*.whl"))
    found = [w for w in found if tag is None or f"-{tag}-" in w.name]
    return found[0] if found else None


def collect(dest: Path) -> list[Path]:
    """Put the carried wheels into ``dest`` (from the cache, downloading what is missing)."""
    cache = plan.CACHE / "wheels"
    cache.mkdir(parents=True, exist_ok=True)
    dest.mkdir(parents=True, exist_ok=True)
    chosen: list[Path] = []
    for name in plan.CARRIED_WHEELS:
        version = metadata.version(name)
        compiled = name == "pydantic-core"
        for python in plan.CORE_PYTHONS if compiled else (plan.DEVICE_PYTHON,):
            tag = f"cp{python[0]}{python[1]}" if compiled else None
            wheel = _cached(cache, name, version, tag)
            if wheel is None:
                _download(name, version, python, cache)
                wheel = _cached(cache, name, version, tag)
            if wheel is None:
                raise RuntimeError(f"no wheel of {name}=={version} for {tag or 'any Python'}")
            chosen.append(wheel)
    names = {w.name for w in chosen}
    for stale in dest.glob("*.whl"):
        if stale.name not in names:
            stale.unlink()
    for wheel in chosen:
        if not (dest / wheel.name).exists():
            shutil.copy2(wheel, dest / wheel.name)
    return [dest / w.name for w in chosen]


def select(folder: Path, python: tuple[int, int] | None = None) -> list[Path]:
    """The wheels in ``folder`` for this interpreter: every pure one, and the compiled ones whose
    CPython tag matches (pip refuses a set holding two versions of one package)."""
    major, minor = python or sys.version_info[:2]
    tag = f"-cp{major}{minor}-"
    picked = []
    for wheel in sorted(folder.glob("*.whl")):
        if "-none-any.whl" in wheel.name or tag in wheel.name:
            picked.append(wheel)
    compiled = {w.name.split("-")[0] for w in folder.glob("*.whl") if "-none-any" not in w.name}
    missing = compiled - {w.name.split("-")[0] for w in picked}
    if missing:
        raise RuntimeError(
            f"no wheel of {', '.join(sorted(missing))} for CPython {major}.{minor} in {folder}"
        )
    return picked


def install_command(python: str, wheels: list[Path], target: Path) -> list[str]:
    """The device tool's documented install (no index, no dependencies, into a target folder)."""
    return [
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(target),
        *map(str, wheels),
    ]
