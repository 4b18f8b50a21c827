"""The built image itself: the llama.cpp CPU variant it loads here, and what its layers hold."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.container.podman_support import LIMITS, RunContainer, podman, record

# Each libggml-cpu-<variant>.so scores itself for the CPU it runs on (0: cannot run here); ggml
# loads the highest. Read here straight from the variants, not through Arbiter's loader.
_SCORES = r"""
import ctypes, json, pathlib, sys
import llama_cpp  # maps libggml-base.so.0, which the variants need (as in ggml's own loader)
scores = {}
for path in sorted(pathlib.Path(sys.prefix).rglob("libggml-cpu-*.so")):
    score = ctypes.CDLL(str(path)).ggml_backend_score
    score.restype = ctypes.c_int
    scores[path.name[len("libggml-cpu-"):-len(".so")]] = score()
print(json.dumps(scores))
"""


def test_the_loaded_cpu_variant_is_logged_and_is_the_best_for_this_cpu(
    image: str, run_container: RunContainer
):
    container = run_container(command=("serve",))
    container.wait_log('"listening"')
    variant = container.preflight()["ggml_cpu_variant"]
    assert variant, container.logs()
    scores = json.loads(
        podman("run", "--rm", *LIMITS, "--entrypoint", "python", image, "-c", _SCORES).stdout
    )
    assert len(scores) >= 10, scores  # x64, sse42, sandybridge, haswell, skylakex, icelake, ...
    assert scores[variant] == max(scores.values()) > 0, (variant, scores)
    flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)[1].split())
    if "avx2" in flags:
        assert variant not in {"x64", "sse42", "sandybridge"}
    if "avx512f" in flags:
        assert variant not in {"haswell", "alderlake"}
    record("ggml CPU variant loaded", variant)


def _extra_certificates(host_bundle: Path, image_bundle: bytes) -> list[bytes]:
    """PEM blocks of the bundle given to the build that the image's own CA bundle lacks (the
    proxy's CA on these machines): their base64 bodies, one line each."""
    pem = re.compile(rb"-----BEGIN CERTIFICATE-----\s+(.*?)-----END CERTIFICATE-----", re.S)
    own = {re.sub(rb"\s", b"", m) for m in pem.findall(image_bundle)}
    extra = []
    for block in pem.findall(host_bundle.read_bytes()):
        body = re.sub(rb"\s", b"", block)
        if body not in own:
            extra.append(block.split(b"\n")[0].strip())  # its first 64-character line
    return extra


def _layer_files(archive: Path) -> Iterator[tuple[str, str, bytes]]:
    """(layer, path, content) of every regular file in every layer of a `podman save` archive."""
    with tarfile.open(archive) as outer:
        for member in outer.getmembers():
            if not member.name.endswith(".tar"):
                continue
            handle = outer.extractfile(member)
            assert handle is not None
            with tarfile.open(fileobj=handle, mode="r|") as layer:
                for entry in layer:
                    if entry.isfile():
                        data = layer.extractfile(entry)
                        assert data is not None
                        yield member.name, entry.name, data.read()
                    elif entry.name.lstrip("./").startswith("run/secrets"):
                        yield member.name, entry.name, b""


def test_the_ca_bundle_given_to_the_build_is_in_no_layer(image: str, tmp_path: Path):
    """pip inside the build trusted the host's CA bundle (a build secret); the image a user ships
    holds neither that file nor any certificate from it that Debian's bundle lacks."""
    given = os.environ.get("ARBITER_BUILD_CA_BUNDLE")
    if not given:
        pytest.skip("the build was given no CA bundle (no TLS-intercepting proxy here)")
    bundle = Path(given)
    image_bundle = podman(
        "run", "--rm", *LIMITS, "--entrypoint", "cat", image, "/etc/ssl/certs/ca-certificates.crt"
    ).stdout.encode()
    extra = _extra_certificates(bundle, image_bundle)
    secret_sha = hashlib.sha256(bundle.read_bytes()).hexdigest()

    archive = tmp_path / "image.tar"
    podman("save", "--format", "docker-archive", "--output", str(archive), image, timeout=600)
    files = 0
    for layer, path, data in _layer_files(archive):
        files += 1
        assert not path.lstrip("./").startswith("run/secrets"), (layer, path)
        assert hashlib.sha256(data).hexdigest() != secret_sha, (layer, path)
        for needle in extra:
            assert needle not in data, f"a certificate of {bundle} is in {layer}:{path}"
    assert files > 1000  # the whole image was read: Debian, Python, the venv
    record("CA certificates given to the build that are in no layer", len(extra))
    history = podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    assert str(bundle) not in history
