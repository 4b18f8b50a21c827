"""Bad decisions are refused at the edge with an error that names the field."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from arbiter.errors import ArbiterError
from arbiter.lines import parse_decision_line


def _line(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": "d1",
        "state": "A state.",
        "question": "Which?",
        "options": [{"id": "a", "description": "A"}, {"id": "b", "description": "B"}],
    }
    base.update(overrides)
    return base


def _nest(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _error(raw: dict[str, Any] | str) -> ArbiterError:
    import json

    text = raw if isinstance(raw, str) else json.dumps(raw)
    with pytest.raises(ArbiterError) as info:
        parse_decision_line(text)
    return info.value


@pytest.mark.parametrize(
    ("overrides", "param", "needle"),
    [
        (
            {"options": [{"id": "a", "description": "A"}, {"id": "a", "description": "B"}]},
            "options",
            "duplicate",
        ),
        ({"question": ""}, "question", "at least 1"),
        ({"question": "   "}, "question", "blank"),
        ({"options": [{"id": "a", "description": "A"}]}, "options", "at least 2"),
        ({"options": []}, "options", "at least 2"),
        ({"state": ""}, "state", "empty"),
        ({"state": {}}, "state", "empty"),
        ({"id": ""}, "id", "at least 1"),
        (
            {"options": [{"id": "a", "description": "A"}, {"id": "b", "description": "  "}]},
            "options.1.description",
            "blank",
        ),
        (
            {"options": [{"id": "a"}, {"id": "b", "description": "B"}]},
            "options.0.description",
            "required",
        ),
        ({"temperature": 0}, "temperature", "greater than or equal to 0.01"),
        ({"temperature": 1e-310}, "temperature", "greater than or equal to 0.01"),
        ({"temperature": 1e308}, "temperature", "less than or equal to 100"),
        ({"question": "Which \ud800?"}, "question", "unicode"),
        ({"id": "\udfff"}, "id", "unicode"),
        ({"state": "text \ud800"}, "state", "unicode"),
        ({"state": {"k": ["ok", "\ud800"]}}, "state", "surrogate"),
        (
            {"options": [{"id": "a", "description": "A \ud83d"}, {"id": "b", "description": "B"}]},
            "options.0.description",
            "unicode",
        ),
        (
            {"state": {"a": [[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]} | {"deep": _nest(70)}},
            "state",
            "nested",
        ),
        ({"extra_field": 1}, "extra_field", "not permitted"),
    ],
)
def test_invalid_decisions_name_the_field(
    overrides: dict[str, Any], param: str, needle: str
) -> None:
    err = _error(_line(**overrides))
    assert err.param is not None and err.param.startswith(param), err.param
    assert needle in err.message.lower(), err.message
    assert err.status == 422


def test_missing_fields_are_named() -> None:
    raw = _line()
    del raw["question"]
    assert _error(raw).param == "question"


def test_state_with_nan_is_not_json() -> None:
    from pydantic import ValidationError

    from arbiter.schema import DecisionRequest

    with pytest.raises(ValidationError, match="JSON-serializable"):
        DecisionRequest.model_validate(_line(state={"x": math.nan}))


def test_malformed_json_line() -> None:
    err = _error('{"id": "x", ')
    assert err.code == "invalid_json" and err.status == 400
    assert _error("[1, 2]").code == "invalid_type"


def test_state_may_be_string_object_or_array() -> None:
    import json

    for state in ("text", {"k": [1, 2]}, [1, "two", None]):
        assert parse_decision_line(json.dumps(_line(state=state))).state == state


def test_a_state_key_with_a_lone_surrogate_is_refused() -> None:
    err = _error(_line(state={"\ud800": 1}))
    assert err.param is not None and err.param.startswith("state")


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("[" * 5000, "nested too deeply"),
        ('{"id": ' + "1" * 5000 + "}", "4300"),
        ('{"id": "x", "temperature": NaN}', "NaN"),
        ('{"id": "x", "temperature": -Infinity}', "Infinity"),
    ],
)
def test_json_that_python_cannot_or_should_not_read_is_malformed(line: str, needle: str) -> None:
    err = _error(line)
    assert err.code == "invalid_json" and err.status == 400
    assert needle in err.message


def test_a_state_as_deep_as_allowed_is_accepted() -> None:
    from arbiter.schema import MAX_STATE_DEPTH

    ok = parse_decision_line(json.dumps(_line(state={"k": _nest(MAX_STATE_DEPTH - 1)})))
    assert ok.state == {"k": _nest(MAX_STATE_DEPTH - 1)}
