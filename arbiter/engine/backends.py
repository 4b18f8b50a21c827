"""llama.cpp set-up, once per process: loadable backends (``GGML_BACKEND_DL=ON``), logs, init.

The container images build llama-cpp-python with ``GGML_BACKEND_DL=ON GGML_CPU_ALL_VARIANTS=ON``: the
CPU backend is compiled once per x86 feature level (sse42, haswell, skylakex, icelake, zen4, ...) as
a separate ``libggml-cpu-*.so`` and ggml loads the best one for the CPU it runs on (each variant
scores itself). Such a build has *no* backend until ``ggml_backend_load_all*`` is called, and
llama-cpp-python does not call it (abetlen/llama-cpp-python#2069): model loading fails with "no
backends are loaded". Every process that loads a model calls :func:`init` once first (the engine
does); the container entrypoint calls :func:`load_backends` and logs the variant it got. On a
build with the backends linked in (the development venv) it loads nothing.

The registry that matters is the one in the ``libggml`` that ``libllama`` is linked against, so the
ggml functions are looked up through ``libllama``'s own handle. pip installs ``libggml.so``,
``libggml.so.0`` and ``libggml.so.0.x.y`` as three separate *copies* (a wheel holds no symlinks):
opening ``libggml.so`` by file name maps a second ggml with a registry of its own, where backends
registered are never seen by ``libllama`` (the image builds, then no model loads).
"""

from __future__ import annotations

import ctypes
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_VARIANT = re.compile(r"/libggml-cpu-([A-Za-z0-9_]+)\.so\b")


@dataclass(frozen=True)
class Backends:
    """What :func:`load_backends` found: the registry size libllama sees, the directory it loaded
    dynamic backends from (None: they were linked in), and the CPU variant mapped in this process."""

    count: int
    loaded_from: Path | None
    cpu_variant: str | None


_loaded: Backends | None = None


def _candidate_dirs(llama_dir: Path) -> list[Path]:
    # llama-cpp-python installs its libraries in llama_cpp/lib; MODULE targets (the backends) have
    # landed in the wheel's bin/ in some versions.
    return [llama_dir / "lib", llama_dir.parent / "bin", Path(sys.prefix) / "bin"]


def _libllama() -> ctypes.CDLL:
    """libllama as llama-cpp-python loaded it; ``dlsym`` through this handle resolves ggml's
    functions in the libggml that libllama itself uses."""
    from llama_cpp import llama_cpp as bindings

    lib: ctypes.CDLL = bindings._lib
    return lib


def registry_count() -> int:
    """How many backends are registered in the ggml that libllama sees."""
    fn = _libllama()["ggml_backend_reg_count"]  # [] gives a fresh function object, not a shared one
    fn.argtypes = []
    fn.restype = ctypes.c_size_t
    return int(fn())


def loaded_cpu_variant(maps: Path = Path("/proc/self/maps")) -> str | None:
    """The ``libggml-cpu-<variant>.so`` mapped into this process (``zen4``, ``haswell``...), if any.

    ggml scores every variant, unloads the losers and keeps the best, so exactly one is mapped
    after :func:`load_backends` on a runtime-dispatch build; None on a build without variants."""
    try:
        text = maps.read_text()
    except OSError:  # not Linux
        return None
    found = sorted(set(_VARIANT.findall(text)))
    return ",".join(found) or None


_GGML_LOG_LEVEL_ERROR = 4  # ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5


_collecting = threading.local()  # llama.cpp logs from the thread that calls it


def _stderr_errors_only(level: int, text: bytes | None, user_data: ctypes.c_void_p) -> None:
    if level == _GGML_LOG_LEVEL_ERROR and text:
        message = text.decode("utf-8", "replace")
        collected: list[str] | None = getattr(_collecting, "lines", None)
        if collected is not None:
            collected.append(message)
        else:
            sys.stderr.write(message)


@contextmanager
def collected_errors() -> Iterator[list[str]]:
    """llama.cpp's error lines logged by this thread inside the block, collected instead of
    written to stderr (a grammar's parse error becomes the caller's 4xx message)."""
    lines: list[str] = []
    _collecting.lines = lines
    try:
        yield lines
    finally:
        _collecting.lines = None


_log_callback: object = None  # kept alive for as long as llama.cpp may call it
_init_lock = threading.Lock()
_initialized = False


def route_llama_logs() -> None:
    """Only llama.cpp's and ggml's errors reach stderr; their chatty load and graph lines (and
    "load_backend: loaded CPU backend from ...", which would break a process whose output is one
    line: the entrypoint) are dropped."""
    global _log_callback
    import llama_cpp

    if _log_callback is None:
        _log_callback = llama_cpp.llama_log_callback(_stderr_errors_only)
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))


def init() -> None:
    """Once per process, before the first model: logs routed, backends loaded, llama.cpp started."""
    global _initialized
    with _init_lock:
        if not _initialized:
            import llama_cpp

            route_llama_logs()
            load_backends()  # a GGML_BACKEND_DL build (the CPU image) has none until loaded
            llama_cpp.llama_backend_init()
            _initialized = True


def gpu_offload_supported() -> bool:
    """Whether this llama.cpp build can offload layers to a GPU (its backends loaded first: a
    GGML_BACKEND_DL build reports no GPU until they are)."""
    import llama_cpp

    load_backends()
    return bool(llama_cpp.llama_supports_gpu_offload())


def load_backends(search: list[Path] | None = None) -> Backends:
    """Register the dynamically loadable backends in libllama's ggml if it has none (once per
    process); returns what is registered."""
    global _loaded
    if _loaded is not None and _loaded.count:
        return _loaded
    import llama_cpp  # loads libllama and, with it, libggml

    loaded_from: Path | None = None
    if registry_count() == 0:
        load_all = _libllama()["ggml_backend_load_all_from_path"]
        load_all.argtypes = [ctypes.c_char_p]
        load_all.restype = None
        llama_dir = Path(llama_cpp.__file__).parent
        for directory in search or _candidate_dirs(llama_dir):
            if any(directory.glob("libggml-cpu*.so")):
                load_all(str(directory).encode())
                loaded_from = directory
                break
    _loaded = Backends(registry_count(), loaded_from, loaded_cpu_variant())
    return _loaded


if __name__ == "__main__":  # the image build checks that a backend loads
    found = load_backends()
    print(
        f"ggml backends registered: {found.count}; CPU variant: {found.cpu_variant or 'built in'}"
        + (f" (from {found.loaded_from})" if found.loaded_from else "")
    )
    raise SystemExit(0 if found.count else 1)
