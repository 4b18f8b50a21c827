"""What an engine loads, found and checked once, without llama.cpp: the model file, its LoRA
adapters and its prompt profile (and the calibration file, if one is set).

A server finds them before it binds its port and a pool before it spawns its workers, so that a
refusal is one line before anything starts; the server then loads exactly what it checked
(``Engine(settings, files)``) instead of resolving the same settings again.
"""

from __future__ import annotations

from dataclasses import dataclass

from arbiter.engine.calibration import Calibration
from arbiter.lora import Adapter, resolve_adapters
from arbiter.models import ResolvedModel, require_weights, resolve_model
from arbiter.profiles import Profile, resolve_profile
from arbiter.settings import EngineSettings


@dataclass(frozen=True)
class ModelFiles:
    """The files one engine serves: the model found, its adapters (each checked against the
    model's tensors, sha256 taken) and the prompt profile served with it."""

    model: ResolvedModel
    adapters: tuple[Adapter, ...]
    profile: Profile


def check_files(settings: EngineSettings, weights: bool = True) -> ModelFiles:
    """The files ``settings`` name, or the ``ModelLoadError`` loading them would raise (a missing
    model, a vocabulary-only GGUF with no weights unless ``weights`` is false, an adapter that
    does not fit it, a profile that does not parse, a calibration file that cannot be read)."""
    model = resolve_model(settings.model, settings.model_dir)
    if weights:
        require_weights(model.path)
    adapters = resolve_adapters(settings.lora, model, settings.model_dir)
    profile = resolve_profile(settings.prompt_profile, model)
    if settings.calibration is not None:
        Calibration.load(settings.calibration)
    return ModelFiles(model, tuple(adapters), profile)
