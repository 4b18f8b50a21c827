"""The layout's dependency rules, read from the source: every import, lazy ones inside functions too.

The core (``arbiter/``, but for its CLI composition root) imports no entry point and no HTTP or AWS
library; the entry points (``adapter``, ``worker``, ``evaluation``, ``infra``, ``emulator``) import
the core and not each other, but for the one edge ``ALLOWED`` names; nothing imports ``bench`` but
the CLI; only the engine's ``llama`` and ``backends`` modules touch llama.cpp.
"""

from __future__ import annotations

import ast
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


def test_the_readme_architecture_names_every_module() -> None:
    """The README's tree is the map a newcomer reads: a module it does not name is a room missing
    from the map (bench suites are named by their pattern, ``<suite>_bench.py``)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Architecture", 1)[1].split("\n## ", 1)[0]
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
