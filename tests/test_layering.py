"""The layout's dependency rules, read from the source: every import, lazy ones inside functions too.

The core (``arbiter/``, but for its CLI composition root) imports no entry point and no HTTP or AWS
library; the entry points (``adapter``, ``worker``, ``evaluation``, ``infra``, ``emulator``) import
the core and not each other, but for the one edge ``ALLOWED`` names; nothing imports ``bench`` but
the CLI; only the engine's ``llama`` and ``backends`` modules touch llama.cpp. The two development
tools, ``bench`` and ``gpucheck``, do not import each other: what both need (how llama.cpp is built)
is in the core, standard library only. Nothing the wheel packages imports a package it leaves out.
No two modules import each other, type-checking imports included.
"""

from __future__ import annotations

import ast
import fnmatch
import sys
import tomllib
from pathlib import Path

import pytest

from tests import ROOT

CORE = "arbiter"
ENTRY_POINTS = ("adapter", "worker", "evaluation", "infra", "emulator")
# The emulator is defined by the deployment: it evaluates infra's templates for its endpoint and
# builds the transform job infra defines (so local and AWS cannot drift). Nothing imports it.
ALLOWED = {"emulator": {"infra"}}
BENCH = "bench"
GPU_CHECK = "gpucheck"  # a development tool, like bench: nothing in the product imports it
COMPOSITION_ROOT = Path("arbiter/cli.py")
HTTP_AND_AWS = ("aiohttp", "aiobotocore", "botocore", "boto3", "moto", "prometheus_client")
# The engine's llama modules (the docstring's two, and the sampler chain and grammar modules).
LLAMA_MODULES = {
    Path("arbiter/engine/llama.py"),
    Path("arbiter/engine/decoding.py"),  # the model's decoding, a part of Llama
    Path("arbiter/engine/kv_memory.py"),  # its KV cells: cleared, branched, saved, restored
    Path("arbiter/engine/vocabulary.py"),  # the model's vocabulary: tokenize, token pieces
    Path("arbiter/engine/batch.py"),  # one llama_decode call's batch struct, filled from numpy
    Path("arbiter/engine/backends.py"),
    Path("arbiter/engine/sampler.py"),  # the sampler chain and grammars (llama_sampler_*)
    Path("arbiter/engine/grammar.py"),  # llama-cpp-python's JSON-schema-to-GBNF converter
}


def modules(package: str) -> list[Path]:
    return sorted(p.relative_to(ROOT) for p in (ROOT / package).rglob("*.py"))


def imported(path: Path) -> set[str]:
    """The top-level package of everything ``path`` imports, wherever in the file."""
    tree = ast.parse((ROOT / path).read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {name.split(".")[0] for name in names}


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, by its whole dotted name (``from a import b`` names ``a.b``
    too, as ``b`` may be a module)."""
    tree = ast.parse((ROOT / path).read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _violations(paths: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {str(p): sorted(imported(p) & set(forbidden)) for p in paths}
    return {path: names for path, names in found.items() if names}


def test_the_core_imports_no_entry_point_and_no_http_or_aws_library() -> None:
    core = [p for p in modules(CORE) if p != COMPOSITION_ROOT]
    assert len(core) > 10
    assert _violations(core, (*ENTRY_POINTS, BENCH, GPU_CHECK, *HTTP_AND_AWS)) == {}


@pytest.mark.parametrize("package", ENTRY_POINTS)
def test_an_entry_point_imports_the_core_not_another_entry_point(package: str) -> None:
    others = tuple(p for p in ENTRY_POINTS if p != package and p not in ALLOWED.get(package, ()))
    assert _violations(modules(package), (*others, BENCH, GPU_CHECK)) == {}


def test_the_composition_root_imports_entry_points_only_by_name_when_run() -> None:
    """``arbiter.cli`` names each subcommand's package and imports only the one that runs."""
    assert imported(COMPOSITION_ROOT) & {*ENTRY_POINTS, BENCH} == set()
    from arbiter.cli import COMMANDS

    packages = {module.split(".")[0] for module in COMMANDS.values()}
    assert packages == {CORE, *ENTRY_POINTS, BENCH}


def test_only_the_engines_llama_modules_touch_llama_cpp() -> None:
    product = [p for package in (CORE, *ENTRY_POINTS) for p in modules(package)]
    touching = {p for p in product if "llama_cpp" in imported(p)}
    assert touching == LLAMA_MODULES


def test_the_rules_see_lazy_imports(tmp_path: Path) -> None:
    """An import inside a function counts like one at the top (the old adapter/cli.py imported
    ``bench`` lazily and the worker imported the engine lazily)."""
    source = ROOT / "tests" / "_layering_probe.py"
    source.write_text("def f():\n    from bench.common import ok\n    import aiohttp.web\n")
    try:
        assert imported(source.relative_to(ROOT)) == {"bench", "aiohttp"}
    finally:
        source.unlink()


def test_the_architecture_tree_names_every_module() -> None:
    """The tree in docs/architecture.md is the map a newcomer reads: a module it does not name is a
    room missing from the map (bench suites are named by their pattern, ``<suite>_bench.py``)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("## The tree", 1)[1].split("\n## ", 1)[0]
    tree = section.split("```", 2)[1]
    missing = [
        str(path)
        for package in (CORE, *ENTRY_POINTS, BENCH)
        for path in modules(package)
        if path.name != "__init__.py"
        and not (package == BENCH and path.name.endswith("_bench.py"))
        and path.name not in tree
    ]
    assert missing == []


LLAMA_BUILD = Path("arbiter/llama_build.py")


def test_bench_and_the_gpu_check_do_not_import_each_other() -> None:
    """bench's llama-server used gpucheck's sdist and flags, and the GPU check's agreement stage
    used bench's decision builders: a circle, and a packaged command (``arbiter bench peers``) that
    needed a package the wheel leaves out. The shared facts live in the core (``LLAMA_BUILD``);
    the agreement stage is bench's, run by the GPU check as a command."""
    assert _violations(modules(BENCH), (GPU_CHECK,)) == {}
    assert _violations(modules(GPU_CHECK), (BENCH,)) == {}


def test_what_the_gpu_check_takes_from_the_core_is_standard_library_only() -> None:
    """On the accelerator machine the GPU check runs before any wheel is installed, and the
    Makefile runs ``arbiter.llama_build`` before the virtual environment exists."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    assert imported(LLAMA_BUILD) - stdlib == set()
    taken = {
        name
        for path in modules(GPU_CHECK)
        for name in imported_modules(path)
        if name.startswith(f"{CORE}.") and _is_module(name)
    }
    # The rehearsal (which runs here, with the project installed) also finds the bundled model.
    assert taken <= {"arbiter.llama_build", "arbiter.models"}


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _packaged() -> tuple[list[str], dict[str, str]]:
    """pyproject.toml's package patterns, and its console scripts."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    return list(patterns), dict(project["project"]["scripts"])


def test_nothing_the_wheel_packages_imports_a_package_it_leaves_out() -> None:
    patterns, scripts = _packaged()
    ours = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    packaged = {name for name in ours if any(fnmatch.fnmatch(name, pat) for pat in patterns)}
    for target in scripts.values():
        assert target.split(".")[0] in packaged, (
            f"a console script's module is not packaged: {target}"
        )
    found = {
        str(path): sorted((imported(path) & ours) - packaged)
        for package in sorted(packaged)
        for path in modules(package)
    }
    assert {path: names for path, names in found.items() if names} == {}


def _module_name(path: Path) -> str:
    parts = path.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports (type-checking-only imports too: a drawing of
    the layers shows them). ``from pkg import sub`` is an edge to ``pkg.sub`` alone when ``sub`` is
    a module, not to ``pkg``'s ``__init__``, which a package's own modules may not import from."""
    paths = [p for pkg in (CORE, *ENTRY_POINTS, BENCH, GPU_CHECK) for p in modules(pkg)]
    known = {_module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        name = _module_name(path)
        tree = ast.parse((ROOT / path).read_text(), str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in known)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & known
                edges.update(subs)
                if len(subs) < len(node.names) and node.module in known:
                    edges.add(node.module)
        graph[name] = edges - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_modules_import_each_other() -> None:
    """A circle of modules is one concern cut in two (emulator's asynchronous and state modules
    were one; adapter's state and execution another, by a type-checking import)."""
    graph = _module_graph()
    assert len(graph) > 100
    assert _circles(graph) == []
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
