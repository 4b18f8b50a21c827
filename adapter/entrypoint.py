"""The container entrypoint: check the model and the build, then exec `arbiter serve` or `arbiter work`.

SageMaker starts a hosting container as ``docker run IMAGE serve``; the worker pool's task runs
``IMAGE work``. The Dockerfiles declare ``ENTRYPOINT ["python", "-m", "arbiter", "entrypoint"]`` in
exec form, and this module *replaces itself* (``os.execv``) with the Arbiter command, so the server or the
pool is the container's PID 1 and receives SIGTERM directly (both install handlers for it: PID 1 gets
no default signal action from the kernel).

Before the exec, in this order, each failure a one-line reason on stderr and exit status 2:

1. the settings are read as ``arbiter`` will read them (``ARBITER_*``, ``SM_LLAMA_CPP_*``; a model hub
   flag is refused);
2. the image default for GPU layers is applied (``ARBITER_IMAGE_N_GPU_LAYERS``: ``-1`` in the CUDA
   image, ``0`` in the CPU image) unless the deployment set the layers itself, and `serve` listens
   on every interface (``ARBITER_HOST=0.0.0.0``, which SageMaker needs: it reaches the container
   from outside) unless the deployment named one; outside a container `arbiter serve` listens on
   127.0.0.1;
3. a GPU layer count on a llama.cpp build without a GPU backend is refused;
4. when ``ARBITER_MODEL_DATA_URL`` names an ``s3://`` archive and no GGUF is in the model dir, the
   archive is downloaded and unpacked there (SageMaker does this itself from ``ModelDataUrl``; ECS
   does not);
5. the model is resolved exactly as the engine resolves it, and its sha256 checked against the
   ``model-manifest.json`` beside it; a path that cannot be written or read (a read-only root
   filesystem, a model dir without permission) is named in the reason, never a traceback.
6. the prompt profile (``ARBITER_PROMPT_PROFILE``, or the manifest's) is parsed and checked, the
   model's chat template rendered for a decision (a template error is one line naming
   ``tokenizer.chat_template``), and a profile's own labels tokenized in the model's vocabulary
   (a vocabulary-only load, no weights);
   each LoRA adapter (``ARBITER_LORA``, ``SM_LLAMA_CPP_LORA``, or the manifest's) is checked against
   the model's tensors and its sha256 against the manifest.

The report line it logs names the ggml CPU variant that llama.cpp loaded for this CPU (the CPU image
carries one per x86 feature level; ``ggml_cpu_variant``).

Runs outside Docker too: ``python -m arbiter entrypoint serve`` (the tests do).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tarfile
import tempfile
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from arbiter.engine.backends import gpu_offload_supported
from arbiter.errors import ArbiterError, ModelLoadError
from arbiter.settings import SM_GPU_FLAGS, SM_PREFIX, EntrypointSettings

COMMANDS = ("serve", "work")


class Refused(Exception):
    """The container must not start; the message says why and what to change."""


def apply_image_defaults(env: MutableMapping[str, str], image_n_gpu_layers: int | None) -> None:
    """``ARBITER_N_GPU_LAYERS`` from the image default when neither it nor an explicit
    ``SM_LLAMA_CPP_N_GPU_LAYERS``-style flag is set (``auto`` counts as unset)."""
    if image_n_gpu_layers is None or "ARBITER_N_GPU_LAYERS" in env:
        return
    for flag in SM_GPU_FLAGS:
        value = env.get(f"{SM_PREFIX}{flag}")
        if value is not None and value.strip().lower() != "auto":
            return
    env["ARBITER_N_GPU_LAYERS"] = str(image_n_gpu_layers)


def apply_serve_defaults(env: MutableMapping[str, str], command: str) -> None:
    """A container's server listens on every interface unless ``ARBITER_HOST`` says otherwise."""
    if command == "serve":
        env.setdefault("ARBITER_HOST", "0.0.0.0")


def _unusable_path(exc: OSError) -> str:
    where = exc.filename or "a model path"
    return (
        f"cannot use {where}: {exc.strerror or exc}. The model dir and the default model must be "
        "readable, and a path Arbiter writes (a model archive's unpack dir, the user cache when no "
        "model is in the image) writable: with a read-only root filesystem, mount the model at "
        "/opt/ml/model or a volume at that path."
    )


def check_gpu_layers(
    n_gpu_layers: int, supported: Callable[[], bool] = gpu_offload_supported
) -> None:
    if n_gpu_layers != 0 and not supported():
        raise Refused(
            f"n_gpu_layers={n_gpu_layers} (ARBITER_N_GPU_LAYERS or SM_LLAMA_CPP_N_GPU_LAYERS) asks "
            "for GPU offload, but this image's llama.cpp was built without a GPU backend. Use the "
            "CUDA image (container/Dockerfile.cuda) on a GPU instance, or set "
            "ARBITER_N_GPU_LAYERS=0 to run on the CPU."
        )


def _split_s3(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or not parts.path.strip("/"):
        raise Refused(f"ARBITER_MODEL_DATA_URL={url!r} is not an s3://bucket/key URL")
    return parts.netloc, parts.path.lstrip("/")


def fetch_model_archive(
    url: str, model_dir: Path, client: Any | None = None, endpoint_url: str | None = None
) -> list[str]:
    """Download ``s3://bucket/key.tar.gz`` and unpack it into ``model_dir`` (as SageMaker would).

    The archive is streamed to a temporary file beside the model dir, then extracted with tarfile's
    ``data`` filter (no absolute paths, no ``..``, no links out of the dir, no devices).
    """
    bucket, key = _split_s3(url)
    if client is None:
        import botocore.session

        session = botocore.session.get_session()
        client = session.create_client("s3", endpoint_url=endpoint_url or None)
    model_dir.mkdir(parents=True, exist_ok=True)
    try:
        response = client.get_object(Bucket=bucket, Key=key)
    except Exception as exc:  # botocore's ClientError and connection errors alike
        raise Refused(f"cannot download the model archive {url}: {exc}") from exc
    with tempfile.NamedTemporaryFile(dir=model_dir, prefix=".model-", suffix=".tar.gz") as tmp:
        for chunk in response["Body"].iter_chunks(8 * 1024 * 1024):
            tmp.write(chunk)
        tmp.flush()
        try:
            with tarfile.open(tmp.name, mode="r:gz") as tar:
                names = tar.getnames()
                tar.extractall(model_dir, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise Refused(f"{url} is not a usable model.tar.gz: {exc}") from exc
    return names


def preflight(
    command: str,
    settings: EntrypointSettings,
    *,
    gpu_supported: Callable[[], bool] = gpu_offload_supported,
    s3_client: Any | None = None,
) -> dict[str, Any]:
    """Everything checked before the exec, on ``os.environ`` (which the exec passes on, image
    defaults applied); returns what was found, logged as one JSON line."""
    from arbiter.engine.backends import load_backends, route_llama_logs
    from arbiter.engine.prompting import check_prompts, check_template
    from arbiter.lora import resolve_adapters
    from arbiter.models import _find_in_dir, require_weights, resolve_model, verify
    from arbiter.profiles import DEFAULT_PROFILE, resolve_profile
    from arbiter.settings import from_environment

    apply_image_defaults(os.environ, settings.image_n_gpu_layers)
    apply_serve_defaults(os.environ, command)
    route_llama_logs()  # the report below names the CPU variant; ggml's own line would be a second
    try:
        engine, server, unknown = from_environment()
    except ArbiterError as exc:
        raise Refused(exc.message) from exc
    except ValueError as exc:  # pydantic's ValidationError
        raise Refused(f"invalid setting: {exc}") from exc
    check_gpu_layers(engine.n_gpu_layers, gpu_supported)
    backends = load_backends()

    fetched: list[str] | None = None
    try:
        if settings.model_data_url and engine.model is None and not _find_in_dir(engine.model_dir):
            fetched = fetch_model_archive(
                settings.model_data_url, engine.model_dir, s3_client, settings.aws_endpoint_url
            )
        resolved = resolve_model(engine.model, engine.model_dir)
        sha256 = verify(resolved) if settings.preflight_sha256 else None
        # The prompt profile, and a profile's own labels against the model's vocabulary (no
        # weights loaded; the built-in's letters are checked by the engine's load as before).
        profile = resolve_profile(engine.prompt_profile, resolved)
        if profile.source != f"builtin:{DEFAULT_PROFILE}":
            check_prompts(resolved.path, engine, profile)  # its labels, and the template
        else:
            check_template(resolved.path, engine, profile)  # from the header: milliseconds
        # After the template: a vocabulary is all the checks above read, and a template that
        # cannot render a decision is the more specific refusal.
        require_weights(resolved.path)
        adapters = resolve_adapters(engine.lora, resolved, engine.model_dir)
    except ModelLoadError as exc:
        raise Refused(exc.message) from exc
    except OSError as exc:
        raise Refused(_unusable_path(exc)) from exc
    return {
        "event": "entrypoint_preflight",
        "command": command,
        "model": str(resolved.path),
        "model_source": resolved.source,
        "manifest": resolved.expected_sha256 is not None,
        "sha256": sha256,
        "prompt_profile": profile.name,
        "prompt_profile_sha256": profile.sha256,
        "lora": [{"file": str(a.path), "sha256": a.sha256, "scale": a.scale} for a in adapters],
        "n_gpu_layers": engine.n_gpu_layers,
        "ggml_backends": backends.count,
        "ggml_cpu_variant": backends.cpu_variant,
        "max_in_flight": server.max_in_flight,
        "host": server.host if command == "serve" else None,
        "fetched": fetched,
        "unknown_sm_settings": unknown,
    }


def exec_argv(command: str, args: Sequence[str], override: str | None) -> list[str]:
    program = shlex.split(override) if override else [sys.executable, "-m", "arbiter"]
    return [*program, command, *args]


def main(
    argv: Sequence[str] | None = None,
    *,
    execvpe: Callable[[str, list[str], Mapping[str, str]], object] = os.execvpe,
    gpu_supported: Callable[[], bool] = gpu_offload_supported,
    s3_client: Any | None = None,
) -> int:
    """Check, then replace this process with ``arbiter COMMAND ARGS...``; returns only on a
    refusal (status 2) or when ``execvpe`` is a test stub."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        got = repr(argv[0]) if argv else "nothing"
        print(
            f"arbiter entrypoint: expected one of {', '.join(COMMANDS)} (got {got}). "
            "SageMaker runs `IMAGE serve`; the worker pool runs `IMAGE work`.",
            file=sys.stderr,
        )
        return 2
    command, rest = argv[0], argv[1:]
    try:
        settings = EntrypointSettings()
        report = preflight(command, settings, gpu_supported=gpu_supported, s3_client=s3_client)
    except (Refused, ValueError) as exc:
        print(f"arbiter entrypoint: refusing to start `{command}`: {exc}", file=sys.stderr)
        return 2
    target = exec_argv(command, rest, settings.entrypoint_exec)
    report["exec"] = target
    print(json.dumps(report), file=sys.stderr, flush=True)
    sys.stdout.flush()
    execvpe(target[0], target, dict(os.environ))
    return 0  # only reached with a stub execve


if __name__ == "__main__":
    raise SystemExit(main())
