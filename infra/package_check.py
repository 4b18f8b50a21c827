"""The read check on what `arbiter package-model` packs and `arbiter deploy` ships: the engine
loaded as the serving container loads it (the GGUF, its prompt profile, its LoRA adapters; an
archive unpacked into a model directory and resolved through its manifest), its start-up probes
scored, and a package that would refuse to start refused here, not after a 10-15 minute endpoint
deploy on AWS (the docs' own example profile with the bundled model reads a label mass of 0.106:
unchecked, it would pack and then refuse to start).
"""

from __future__ import annotations

import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

from arbiter.engine.read_check import ReadCheck
from arbiter.settings import EngineSettings

MODES = ("refuse", "warn", "off")
# What the check needs of a context: the probes are short (a few hundred tokens).
_CHECK_CTX = 2048


def _settings(**fields: object) -> EngineSettings:
    """Engine settings from these fields alone: the environment's ARBITER_* never reach a check
    of what is packed (every field that says where the model, profile and adapters are is set)."""
    base: dict[str, object] = {
        "model": None,
        "lora": None,
        "prompt_profile": None,
        "calibration": None,
        "n_ctx": _CHECK_CTX,
        "n_gpu_layers": 0,
        "prefix_cache_mb": 0,
    }
    return EngineSettings.model_validate({**base, **fields})


def _run(settings: EngineSettings) -> ReadCheck:
    """Load the engine and run its read check (``ReadCheckRefused`` in mode refuse), then free
    it."""
    from arbiter.engine import Engine

    engine = Engine(settings)
    try:
        return engine.check_reads()
    finally:
        engine.close()


def check_files(
    gguf: Path, profile: Path | None, loras: Sequence[tuple[Path, float]], mode: str
) -> ReadCheck | None:
    """The read check of a GGUF with the profile and adapters it will be packed with; None in
    mode off. Raises ``ModelLoadError`` (``ReadCheckRefused`` among them) as the engine would."""
    if mode == "off":
        return None
    return _run(
        _settings(
            model=gguf,
            model_dir=gguf.parent,
            prompt_profile=str(profile) if profile is not None else None,
            lora=",".join(f"{path}:{scale}" for path, scale in loras) or None,
            read_check=mode,
        )
    )


def check_archive(archive: Path, mode: str) -> ReadCheck | None:
    """The read check of a packaged archive, unpacked into a model directory as SageMaker
    unpacks ``ModelDataUrl`` into /opt/ml/model; None in mode off."""
    if mode == "off":
        return None
    with tempfile.TemporaryDirectory(prefix="arbiter-check-") as into:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(into, filter="data")
        return _run(_settings(model_dir=Path(into), read_check=mode))


def describe(check: ReadCheck | None) -> str:
    """One line for the operator: what the check measured."""
    if check is None:
        return "read check: off"
    if check.allowed_mass is None:
        return f"read check: {check.mode}"
    against = "" if check.reference_mass is None else f", reference {check.reference_mass:.3f}"
    verdict = "passed" if check.passed else f"FAILED ({check.cause})"
    return f"read check: label mass {check.allowed_mass:.3f}{against}: {verdict}"
