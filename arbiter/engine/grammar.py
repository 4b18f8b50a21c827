"""JSON schemas as GBNF grammars, with the converter llama-cpp-python ships
(``llama_cpp.llama_grammar.SchemaConverter``), for structured outputs.

The schema is checked first (``json_schema``: only constraints the grammar enforces). Three defects
of that converter are corrected here: it did not escape backslashes in literals (a ``const``,
``enum`` value or property name with a quote, a backslash or a newline gave a broken grammar or
invalid JSON), its string characters admitted raw control characters, which JSON forbids inside
strings (both as llama.cpp's own C++ converter does it), and its dates admitted days no month has.
Its patterns are replaced by ``patterns`` (it copied classes and dots into the grammar as they
were); a root ``$ref`` is inlined first (it resolved one without looking inside the definitions).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from llama_cpp import llama_grammar

from arbiter.engine import int_range
from arbiter.engine.json_schema import check_schema, normalized
from arbiter.engine.patterns import pattern_gbnf
from arbiter.errors import UnsupportedParameter

# A JSON string character: anything but a quote, a backslash or a control character, or an escape.
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
# A calendar date: the day in its month's range (29 February, which needs the leap-year rule, left
# out) and no year 0000 (the converter's own rule admits 2023-02-31).
_DATE = (
    '([1-9] [0-9]{3} | "0" [1-9] [0-9]{2} | "00" [1-9] [0-9] | "000" [1-9]) "-" '
    '(("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01]) | '
    '("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30") | '
    '"02" "-" ("0" [1-9] | "1" [0-9] | "2" [0-8]))'
)
_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
_LITERAL_ESCAPE = re.compile(r'[\r\n"\\]')


class _Converter(llama_grammar.SchemaConverter):
    def _format_literal(self, literal: str) -> str:
        return '"' + _LITERAL_ESCAPE.sub(lambda m: _LITERAL_ESCAPES[m.group(0)], literal) + '"'

    def _visit_pattern(self, pattern: str, name: str) -> str:
        """A string of the pattern's whole matches, each character as JSON writes it."""
        add_rule: Any = self._add_rule  # llama_grammar is untyped
        return str(add_rule(name, '"\\"" ' + pattern_gbnf(pattern) + ' "\\"" space'))

    def visit(self, schema: Any, name: str) -> Any:
        """An integer with bounds as the integers in range (the converter drops the bounds)."""
        if isinstance(schema, dict) and schema.get("type") == "integer":
            low, high = int_range.bounds(schema)
            if low is not None or high is not None:
                rule = f"{name}-" if name in llama_grammar.RESERVED_NAMES else name or "root"
                add_rule: Any = self._add_rule
                return add_rule(rule, int_range.gbnf(low, high) + " space")
        visit: Any = super().visit  # llama_grammar is untyped
        return visit(schema, name)

    def _add_primitive(self, name: str, rule: Any) -> str:
        if name == "char":
            rule = llama_grammar.BuiltinRule(_JSON_CHAR, [])
        elif name == "date":
            rule = llama_grammar.BuiltinRule(_DATE, [])
        return str(super()._add_primitive(name, rule))


_CONVERTER: Any = _Converter  # llama_grammar is untyped


def schema_grammar(schema: Any, param: str) -> str:
    """The GBNF grammar of JSON values that validate against ``schema``; ``UnsupportedParameter``
    (naming ``param``) for a schema with a constraint the grammar would not enforce."""
    check_schema(schema, param)
    converter: Any = _CONVERTER(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        root = _inline_root_ref(normalized(copy.deepcopy(schema)))
        resolved = converter.resolve_refs(root, "schema")
        converter.visit(resolved, "")
        return str(converter.format_grammar())
    except RecursionError:
        raise UnsupportedParameter(f"{param}: the schema nests too deeply", param=param) from None
    except Exception as exc:  # the converter's own refusals are asserts and KeyErrors
        raise UnsupportedParameter(
            f"{param}: the schema cannot be turned into a grammar ({type(exc).__name__}: {exc})",
            param=param,
        ) from None


def _inline_root_ref(schema: Any) -> Any:
    """The root's own ``$ref`` replaced by its target, ``$defs`` kept: the converter resolves a
    root ``$ref`` without looking inside the definitions, whose own references then fail (pydantic
    writes a root ``$ref`` for a model that refers to itself)."""
    for _ in range(8):
        if not isinstance(schema, dict) or not isinstance(schema.get("$ref"), str):
            return schema
        target: Any = schema
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        inlined = dict(target)
        for key in ("$defs", "definitions"):
            if key in schema:
                inlined.setdefault(key, schema[key])
        schema = inlined
    return schema


def json_object_grammar() -> str:
    """Any JSON object (``response_format: {"type": "json_object"}`` without a schema)."""
    return schema_grammar({"type": "object"}, "response_format")
