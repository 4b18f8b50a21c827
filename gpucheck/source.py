"""llama.cpp's source, trimmed to what a CUDA or CPU build of the engine's libraries needs.

llama-cpp-python's sdist is 76.6 MB (217 MB unpacked: models, docs, tools, every backend). The
engine needs ``libllama`` and ``libggml`` with the CPU and CUDA backends, and the ``llama_cpp``
Python package that binds them; the model writer needs llama.cpp's own ``gguf-py``. Everything else
stays behind, and the build (:mod:`gpucheck.build`) turns off the parts of llama.cpp's CMake that
would look for it (common, tools, tests, examples, mtmd).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from pathlib import Path, PurePosixPath

from arbiter.llama_build import VENDORED_LLAMA_CPP

LLAMA = VENDORED_LLAMA_CPP
# Kept, relative to the sdist's root; a folder keeps everything below it unless dropped below.
KEEP = (
    "LICENSE.md",
    "llama_cpp",
    f"{LLAMA}/LICENSE",
    f"{LLAMA}/CMakeLists.txt",
    f"{LLAMA}/cmake",
    f"{LLAMA}/include",
    f"{LLAMA}/src",
    f"{LLAMA}/vendor",
    f"{LLAMA}/ggml/CMakeLists.txt",
    f"{LLAMA}/ggml/cmake",
    f"{LLAMA}/ggml/include",
    f"{LLAMA}/ggml/src",
    f"{LLAMA}/gguf-py/LICENSE",
    f"{LLAMA}/gguf-py/gguf",
)
DROP = (
    "llama_cpp/server",  # the OpenAI server: not imported by the engine
    f"{LLAMA}/vendor/cpp-httplib",  # only for common, which is not built
)
# ggml's backends: only these two are built; CMake adds a backend folder only when it is enabled.
GGML_BACKENDS_KEPT = ("ggml-cpu", "ggml-cuda")


def _kept(path: str) -> bool:
    p = PurePosixPath(path)
    if p.suffix == ".pyc" or "__pycache__" in p.parts:
        return False
    if any(p == PurePosixPath(d) or PurePosixPath(d) in p.parents for d in DROP):
        return False
    if not any(p == PurePosixPath(k) or PurePosixPath(k) in p.parents for k in KEEP):
        return False
    ggml_src = PurePosixPath(f"{LLAMA}/ggml/src")
    if ggml_src in p.parents and p.parent != ggml_src:
        backend = p.relative_to(ggml_src).parts[0]
        return backend in GGML_BACKENDS_KEPT
    return True


def trim(sdist: Path, out: Path) -> dict[str, int]:
    """Write the trimmed tree as ``out`` (a .tar.gz with reproducible bytes); return its counts."""
    prefix = sdist.name.removesuffix(".tar.gz") + "/"
    kept = files = 0
    unpacked = 0
    buffer = io.BytesIO()
    with (
        tarfile.open(sdist, "r:gz") as src,
        tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as dst,
    ):
        members = sorted(src.getmembers(), key=lambda m: m.name)
        for member in members:
            if not member.isfile() or not member.name.startswith(prefix):
                continue
            files += 1
            rel = member.name[len(prefix) :]
            if not _kept(rel):
                continue
            data = src.extractfile(member)
            assert data is not None
            info = tarfile.TarInfo("llama-src/" + rel)
            info.size = member.size
            info.mode = member.mode & 0o755 | 0o644
            info.mtime = 0
            dst.addfile(info, data)
            kept += 1
            unpacked += member.size
    out.parent.mkdir(parents=True, exist_ok=True)
    # gzip with a fixed mtime, so the same sdist always gives the same bytes (and cache key).
    with gzip.GzipFile(out, "wb", compresslevel=9, mtime=0) as handle:
        handle.write(buffer.getvalue())
    return {"files_in_sdist": files, "files_kept": kept, "bytes_unpacked": unpacked}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def extract(tarball: Path, dest: Path) -> Path:
    """Unpack a trimmed tree under ``dest`` (once); returns the tree's root (``dest/llama-src``)."""
    root = dest / "llama-src"
    if not (root / "llama_cpp" / "__init__.py").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball, "r:gz") as tar:
            tar.extractall(dest, filter="data")
    return root
