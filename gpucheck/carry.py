"""The carried folder, ``.gpu-carry/``, and the size of everything that travels with the call.

What travels is the working tree (tracked files and untracked files git does not ignore) plus the
carried paths, 64 MiB in all. ``assemble`` writes the folder: the trimmed llama.cpp source, the
default model's skeleton, the wheels, and a manifest. ``travel_size`` adds up exactly what the
device tool would send, so the rehearsal fails here before a call would fail there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from arbiter import llama_build
from gpucheck import plan, source, wheels

SOURCE_NAME = "llama-src.tar.gz"
SKELETON_NAME = "skeleton.gguf.xz"
WHEELS_DIR = "wheels"
MANIFEST_NAME = "manifest.json"


def _gguf_env(gguf_py: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(gguf_py), str(plan.ROOT)])}


def assemble(carry: Path, real_model: Path, work: Path) -> dict[str, Any]:
    """Write ``carry`` (reusing what is already there and current); returns the manifest."""
    carry.mkdir(parents=True, exist_ok=True)
    sdist = llama_build.sdist_path()
    tarball = carry / SOURCE_NAME
    counts = source.trim(sdist, tarball)
    src = source.extract(tarball, work / f"src-{source.digest(tarball)}")
    skeleton = carry / SKELETON_NAME
    made = _current_skeleton(carry, real_model)
    if made is None:
        made = json.loads(
            subprocess.run(
                [sys.executable, "-m", "gpucheck.skeleton", str(real_model), str(skeleton)],
                env=_gguf_env(gguf_py_dir(src)),
                cwd=plan.ROOT,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
    carried = wheels.collect(carry / WHEELS_DIR)
    manifest = {
        "llama_cpp_python": llama_build.LLAMA_CPP_PYTHON_VERSION,
        "source": {"file": SOURCE_NAME, "bytes": tarball.stat().st_size, **counts},
        "skeleton": {"file": SKELETON_NAME, **made},
        "wheels": [w.name for w in carried],
    }
    (carry / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _current_skeleton(carry: Path, real_model: Path) -> dict[str, Any] | None:
    """The skeleton already in ``carry``, if the manifest says it was made from this model file
    and nothing changed it since."""
    skeleton, manifest = carry / SKELETON_NAME, carry / MANIFEST_NAME
    if not (skeleton.is_file() and manifest.is_file()):
        return None
    made = json.loads(manifest.read_text()).get("skeleton", {})
    fresh = skeleton.stat().st_mtime >= real_model.stat().st_mtime
    same = made.get("source") == real_model.name and made.get("bytes") == skeleton.stat().st_size
    return {k: v for k, v in made.items() if k != "file"} if fresh and same else None


def gguf_py_dir(src: Path) -> Path:
    return src / "vendor" / "llama.cpp" / "gguf-py"


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def travel_size(root: Path, carried: tuple[str, ...]) -> dict[str, Any]:
    """Bytes the device tool would send: the working tree git shows, plus each carried path."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    counted = {root / name.decode() for name in filter(None, listed)}
    shared = root / "shared"  # travels where the checkout has one, ignored or not
    if shared.is_dir():
        counted |= {p for p in shared.rglob("*")}
    tree = sum(p.stat().st_size for p in counted if p.is_file() and not p.is_symlink())
    carry = {c: _tree_bytes(root / c) for c in carried}
    total = tree + sum(carry.values())
    return {
        "working_tree_bytes": tree,
        "carried_bytes": carry,
        "total_bytes": total,
        "limit_bytes": plan.TRAVEL_LIMIT_BYTES,
        "margin_bytes": plan.TRAVEL_MARGIN_BYTES,
        "fits": total + plan.TRAVEL_MARGIN_BYTES <= plan.TRAVEL_LIMIT_BYTES,
    }
