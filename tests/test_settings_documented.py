"""Every setting is on docs/configuration.md, with the default the code has.

The settings classes are found, not listed: every module of the packages that imports
pydantic-settings is imported and every `BaseSettings` subclass walked, so a class added tomorrow is
held to the page too. Each environment variable a class reads (its field's aliases, else the prefix
and the field's name) must be named in the first column of one of the page's tables; a default
written there as a number, ``true``/``false``, a code span or "–" (unset) must be the field's. And
every variable the tables name must be one a class reads, so a removed setting leaves the page.
About twelve settings (``ARBITER_LOG_LEVEL``, ``ARBITER_LOG_JSON``, ``ARBITER_MAX_DECISIONS``, ...)
were on no page before this test.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

from pydantic import AliasChoices
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from tests import ROOT

PAGE = ROOT / "docs" / "configuration.md"
PACKAGES = ("arbiter", "adapter", "worker", "evaluation", "bench", "infra", "emulator", "gpucheck")
_VARIABLE = re.compile(r"`((?:ARBITER|SM|SAGEMAKER|ECS)_[A-Z0-9_]+)`")
_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def settings_classes() -> list[type[BaseSettings]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "pydantic_settings" in path.read_text():
                importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
    found, pending = [], list(BaseSettings.__subclasses__())
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        if cls.__module__.split(".")[0] in PACKAGES:
            found.append(cls)
    return found


def variables(cls: type[BaseSettings]) -> dict[str, FieldInfo]:
    """The environment variables ``cls`` reads, each with its field."""
    prefix = str(cls.model_config.get("env_prefix") or "")
    out = {}
    for name, field in cls.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names = [str(choice) for choice in alias.choices]
        elif alias is not None or field.alias is not None:
            names = [str(alias if alias is not None else field.alias)]
        else:
            names = [f"{prefix}{name}".upper()]
        out.update(dict.fromkeys(names, field))
    return out


def table_rows(text: str) -> list[tuple[list[str], str]]:
    """Each table row's variables (the code spans of its first cell) and its second cell."""
    rows = []
    for line in text.splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        )
        if len(cells) >= 2 and _VARIABLE.search(cells[0]):
            rows.append((_VARIABLE.findall(cells[0]), cells[1]))
    return rows


class _Word(str):
    """A default written as one plain word (``refuse``, ``127.0.0.1``): checked against a string."""


def _stated(text: str) -> Any:
    """A documented default as a value, or ``...`` when it is prose (not checked)."""
    text = text.strip()
    if text == "–":
        return None
    if text in ("true", "false"):
        return text == "true"
    if _NUMBER.fullmatch(text):
        return float(text)
    if re.fullmatch(r"`[^`]+`", text):
        return text.strip("`")
    if re.fullmatch(r"[\w.:/-]+", text):
        return _Word(text)
    return ...


def _agrees(stated: Any, default: Any) -> bool:
    if default is PydanticUndefined or stated is ...:
        return True
    if stated is None:
        return default is None
    if default is None:  # a default the code computes when unset, described on the page
        return True
    if isinstance(stated, _Word) and not isinstance(default, str):
        return True
    if isinstance(default, bool) or isinstance(stated, bool):
        return stated is default
    if isinstance(default, int | float) and isinstance(stated, float):
        return float(default) == stated
    return str(default) == str(stated)


def test_every_setting_is_on_the_configuration_page_with_its_default() -> None:
    fields: dict[str, list[FieldInfo]] = {}
    classes = settings_classes()
    assert {c.__name__ for c in classes} >= {
        "EngineSettings",
        "ServerSettings",
        "EntrypointSettings",
        "WorkerSettings",
        "LocalSettings",
        "RuntimeSettings",
    }
    for cls in classes:
        for name, field in variables(cls).items():
            fields.setdefault(name, []).append(field)
    rows = table_rows(PAGE.read_text())
    listed = {name for names, _ in rows for name in names}
    assert sorted(set(fields) - listed) == [], "settings missing from docs/configuration.md"
    assert sorted(listed - set(fields)) == [], "variables on the page that no settings class reads"
    wrong = []
    for names, cell in rows:
        # One default per distinct field of the cell's variables ("a / b"), aliases sharing one.
        distinct: list[str] = []
        for name in names:
            mine = {id(f) for f in fields[name]}
            if not any(mine & {id(f) for f in fields[other]} for other in distinct):
                distinct.append(name)
        parts = cell.split(" / ")
        if len(parts) != len(distinct):
            continue
        for name, part in zip(distinct, parts, strict=True):
            stated = _stated(part)
            if not any(_agrees(stated, field.default) for field in fields[name]):
                wrong.append(f"{name}: the page says {part}, the code {fields[name][0].default!r}")
    assert wrong == []


def test_the_collector_reads_the_first_column_and_the_default() -> None:
    text = (
        "| variable | default | meaning |\n|---|---|---|\n"
        "| `ARBITER_A` / `ARBITER_B` | 1 / `x` | two |\n"
        "| prose `ARBITER_C` | – | one |\n"
        "The `ARBITER_D` of prose is not a row.\n"
    )
    assert table_rows(text) == [(["ARBITER_A", "ARBITER_B"], "1 / `x`"), (["ARBITER_C"], "–")]
    stated = [_stated(s) for s in ("1", "true", "`x`", "–", "refuse", "CPU count")]
    assert stated == [1.0, True, "x", None, "refuse", ...]
    assert _agrees(8192.0, 8192) and not _agrees(4096.0, 8192) and _agrees(..., 1)
    assert _agrees(None, None) and not _agrees(None, 5) and _agrees("/opt", Path("/opt"))
