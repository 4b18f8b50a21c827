"""Structured outputs: the JSON Schema subset is enforced exactly, anything else is refused by
name; generated schemas, generated output, and the output always parses and validates."""

from __future__ import annotations

import datetime
import enum
import json
import re
from typing import Any, Literal

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.lib._pydantic import to_strict_json_schema as openai_strict
from pydantic import BaseModel, Field

from arbiter.engine import Engine, SamplingParams
from arbiter.engine.grammar import json_object_grammar, schema_grammar
from arbiter.errors import UnsupportedParameter
from arbiter.prompt import render_chat
from tests.strategies import SCALE

VALIDATOR = jsonschema.Draft202012Validator
FORMATS = VALIDATOR.FORMAT_CHECKER

REFUSED = [
    ({"type": "number", "minimum": 0}, "'minimum'"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "no integer is at least 5"),
    ({"type": "integer", "minimum": "0"}, "must be a number"),
    ({"type": "integer", "maximum": 1e30}, "within"),
    ({"type": "number", "multipleOf": 2}, "'multipleOf'"),
    ({"type": "string", "pattern": "^(?=a)b$"}, "lookarounds"),
    ({"type": "string", "pattern": r"(a)\1"}, "escape \\1"),
    ({"type": "string", "pattern": "a*?"}, "lazy"),
    ({"type": "string", "pattern": r"\bword"}, "escape \\b"),
    ({"type": "string", "pattern": "a$b"}, "$ only at the end"),
    ({"type": "string", "pattern": "a{5000}"}, "counts up to 1000"),
    ({"type": "string", "pattern": "[z-a]"}, "bad range"),
    ({"type": "string", "pattern": "^a$", "maxLength": 3}, "pattern with"),
    ({"type": "string", "format": "email"}, "format 'email'"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "minItems": 2}, "need items"),
    ({"type": "object", "minProperties": 1}, "'minProperties'"),
    ({"properties": {"a": {}}, "required": ["b"]}, "'b'"),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "discriminated"),
    ({"anyOf": [{"type": "string"}], "type": "object"}, "'type'"),
    ({"type": ["string", "null"], "maxLength": 3}, "'maxLength'"),
    ({"$ref": "https://example.com/schema.json"}, "own #/"),
    ({"$ref": "#/$defs/missing"}, "names nothing"),
    ({"type": "hiccup"}, "hiccup"),
    ({"type": 123}, "123"),
    ({"type": "string", "maxLength": 10**9}, "maxLength"),
    ({"not": {"type": "string"}}, "'not'"),
    ({"if": {"type": "string"}, "then": {}}, "'if'"),
    ({"enum": []}, "non-empty"),
    ({"type": "string", "const": 3}, "not of type"),
    ({"minLength": 2}, "needs type 'string'"),
    ({"allOf": [{"properties": {"a": {}}}, {"properties": {"a": {}}}]}, "distinct"),
    (123, "JSON object"),
    (True, "boolean schemas"),
]


@pytest.mark.parametrize(("schema", "named"), REFUSED, ids=lambda v: str(v)[:40])
def test_a_constraint_the_grammar_would_not_enforce_is_refused_by_name(
    schema: Any, named: str
) -> None:
    with pytest.raises(UnsupportedParameter) as err:
        schema_grammar(schema, "response_format.json_schema.schema")
    assert named in err.value.message
    assert err.value.param == "response_format.json_schema.schema"
    assert err.value.status == 422


def test_deep_nesting_is_refused_not_a_crash() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(3000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(UnsupportedParameter, match="deeply"):
        schema_grammar(schema, "json_schema")


# -- generated schemas, real output -------------------------------------------------------------

# Text that JSON must escape, or that GBNF reads as syntax: quotes, backslashes, newlines, braces.
tricky = st.text(alphabet=st.sampled_from('ab "\\\n\t{}:é'), min_size=1, max_size=6)
scalars = st.one_of(st.integers(-50, 50), st.booleans(), st.none(), tricky)
leaves = st.one_of(
    st.sampled_from(
        [
            {"type": "integer"},
            {"type": "number"},
            {"type": "boolean"},
            {"type": "null"},
            {"type": "string", "format": "date"},
            {"type": "string", "format": "uuid"},
            {"type": "string", "format": "date-time"},
        ]
    ),
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    # Integer bounds (issue 28), as pydantic's conint and Field(ge=...) write them.
    st.tuples(st.integers(-300, 300), st.integers(0, 400)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.integers(-1000, 1000).map(lambda n: {"type": "integer", "exclusiveMinimum": n}),
    st.integers(-1000, 1000).map(lambda n: {"type": "integer", "maximum": n}),
    st.lists(scalars, min_size=1, max_size=4, unique_by=json.dumps).map(lambda v: {"enum": v}),
    scalars.map(lambda v: {"const": v}),
)


# Patterns: classes, escapes, dots and literals that JSON must escape, bounded quantifiers.
pattern_atoms = st.one_of(
    st.sampled_from(
        [r"\d", r"\w", "[a-c]", "[^a-z]", ".", r'["\\]', r"\n", "(x|yz)", "[ -~]", r"\s"]
    ),
    st.sampled_from('ab "\\\n\t{}:é.').map(re.escape),
)
patterns = st.lists(
    st.tuples(pattern_atoms, st.sampled_from(["", "?", "{1,3}", "{2}"])), min_size=1, max_size=4
).map(lambda parts: "^" + "".join(a + q for a, q in parts) + "$")
leaves = st.one_of(leaves, patterns.map(lambda p: {"type": "string", "pattern": p}))


def _objects(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    props = st.dictionaries(tricky, children, min_size=1, max_size=3)
    return st.builds(
        lambda p, k, extra: {
            "type": "object",
            "properties": p,
            "required": list(p)[:k],
            **({"additionalProperties": False} if extra else {}),
        },
        props,
        st.integers(0, 3),
        st.booleans(),
    )


def _extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        _objects(children),
        st.builds(
            lambda item, high: {"type": "array", "items": item, "maxItems": high},
            children,
            st.integers(0, 2),
        ),
        st.lists(children, min_size=2, max_size=3).map(lambda alts: {"anyOf": alts}),
    )


schemas = st.recursive(leaves, _extend, max_leaves=5)


@pytest.mark.real_model
@settings(
    max_examples=8 * SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(schema=schemas, seed=st.integers(0, 2**32))
def test_generated_output_parses_and_validates_against_its_schema(
    chat_engine: Engine, schema: Any, seed: int
) -> None:
    """Sampled at temperature 1 (the model wanders as far as the grammar lets it): whatever it
    writes is JSON that validates, formats included. Every generated schema bounds its output
    (strings have a maxLength, arrays a maxItems), so the grammar ends it within the budget."""
    grammar = schema_grammar(schema, "json_schema")
    prompt = render_chat(
        [("user", "Answer in JSON: " + json.dumps(schema))],
        chat_engine.chat_template,
        chat_engine.bos_text,
        chat_engine.eos_text,
    )
    sampling = SamplingParams(temperature=1.0, seed=seed, grammar=grammar)
    out = chat_engine.generate(
        chat_engine.encode_segments(prompt), max_tokens=300, sampling=sampling
    )
    assert out.finish_reason == "stop", out.text
    VALIDATOR(schema, format_checker=FORMATS).validate(json.loads(out.text))


@pytest.mark.real_model
def test_any_json_object_without_a_schema(chat_engine: Engine) -> None:
    prompt = render_chat(
        [("user", "Give a JSON object with a name and an age.")],
        chat_engine.chat_template,
        chat_engine.bos_text,
        chat_engine.eos_text,
    )
    out = chat_engine.generate(
        chat_engine.encode_segments(prompt),
        max_tokens=200,
        sampling=SamplingParams(temperature=0, grammar=json_object_grammar()),
    )
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)


# -- what pydantic writes (the openai client's structured outputs send these) ---------------------


class Kind(enum.StrEnum):
    cat = "cat"
    dog = "dog"


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Owner(BaseModel):
    name: str = Field(max_length=20)
    born: datetime.date
    nickname: str | None = None
    pet: Cat | Dog = Field(discriminator="kind")
    favourite: Kind
    pair: tuple[int, str]
    friends: list[Owner] = Field(default_factory=list, max_length=2)


@pytest.mark.real_model
def test_the_schemas_pydantic_writes_are_accepted_and_compile(chat_engine: Engine) -> None:
    schema = Owner.model_json_schema()
    assert "$defs" in schema and "oneOf" in json.dumps(schema)  # refs, a discriminated union
    grammar = schema_grammar(schema, "response_format.json_schema.schema")
    chat_engine.check_grammar(grammar)
    strict = openai_strict(Owner)
    chat_engine.check_grammar(schema_grammar(strict, "response_format.json_schema.schema"))


@settings(max_examples=200 * SCALE, deadline=None)
@given(
    low=st.one_of(st.none(), st.integers(-2500, 2500)),
    span=st.one_of(st.none(), st.integers(0, 3000)),
)
def test_integer_bounds_admit_exactly_the_integers_in_range(
    low: int | None, span: int | None
) -> None:
    """The bounds' grammar (int_range, written as GBNF and, with the same parts, as a regex):
    every integer in range and nothing else, each written one way (no leading zero, no -0)."""
    import re

    from arbiter.engine import int_range

    high = None if span is None else (low or 0) + span
    language = re.compile(int_range.regex(low, high))
    for i in range(-4000, 4000):
        inside = (low is None or i >= low) and (high is None or i <= high)
        assert (language.fullmatch(str(i)) is not None) == inside, (low, high, i)
    for text in ("-0", "007", "01", "+1", ""):
        assert language.fullmatch(text) is None
    assert int_range.gbnf(low, high).count("|") == int_range.regex(low, high).count("|")


def test_integer_bounds_reach_the_grammar() -> None:
    """The converter dropped minimum/maximum (its TODO): the grammar admitted any integer."""
    grammar = schema_grammar({"type": "integer", "minimum": 3, "maximum": 7}, "json_schema")
    assert "root ::= ([3-7]) space" in grammar
    pydantic_like = {"type": "integer", "exclusiveMinimum": 0, "maximum": 120}
    assert "[1-9]" in schema_grammar(pydantic_like, "json_schema")


@pytest.mark.parametrize(("low", "high"), [(100, None), (None, -100), (None, 5), (-3, None)])
def test_an_integer_bound_open_on_one_side_stops_at_sixteen_digits(
    low: int | None, high: int | None
) -> None:
    """``minimum: 100`` wrote ``[1-9] [0-9]{2,}``: one sample ran to max_tokens, others were 17
    digits (issue 35); llama.cpp caps a plain integer at 16 digits, and so does an open side."""
    import re

    from arbiter.engine import int_range

    language = re.compile(int_range.regex(low, high))
    sign = "-" if low is None else ""  # the open side
    assert language.fullmatch(sign + "9" * 16)
    assert not language.fullmatch(sign + "1" + "0" * 16)
    assert "," not in int_range.gbnf(low, high)  # no open repeat
    grammar = schema_grammar({"type": "integer", "minimum": 100}, "json_schema")
    assert "{15}" in grammar and ",}" not in grammar
