"""The JSON Schema subset that structured outputs honour exactly, checked before conversion.

llama-cpp-python's JSON-schema-to-GBNF converter (``grammar``) writes a grammar for any schema it
can read, but it drops keywords it has no rule for (``minimum``, ``uniqueItems``, most formats, the
siblings of an ``anyOf``...): output that follows such a grammar need not validate. Generation
here promises output that validates, so every keyword is either one the grammar enforces or an
annotation, and anything else is refused naming the keyword and where it is, before any work.

Honoured: ``type`` (one name, or a list of bare types), ``const``, ``enum``, ``$ref`` to this
schema's own ``$defs``/``definitions`` (recursion included), ``anyOf``, ``oneOf`` of a
discriminated union (every alternative an object whose required property holds a distinct
``const``), ``allOf`` of plain object schemas; objects with ``properties``, ``required`` and
``additionalProperties``; arrays with ``items`` and ``minItems``/``maxItems``, or
``prefixItems`` (or ``items`` as a list, the older tuple form); strings with ``minLength``/``maxLength``, ``format`` date, time, date-time or
uuid, or ``pattern`` (the subset ``patterns`` reads); integers with ``minimum``/``maximum`` (and the
exclusive ones: ``int_range``); numbers, booleans and null without bounds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from arbiter.engine import int_range
from arbiter.engine.patterns import PatternError, pattern_gbnf
from arbiter.errors import UnsupportedParameter

ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "$schema",
        "$id",
        "$comment",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "discriminator",  # OpenAPI's (pydantic writes it beside a oneOf); oneOf is checked itself
        "$defs",  # reached through $ref only
        "definitions",
    }
)
TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid3", "uuid4", "uuid5"})
MAX_COUNT = 1000  # minItems/maxItems/minLength/maxLength: the grammar grows with the count
ANY_VALUE: dict[str, Any] = {"type": sorted(TYPES - {"integer"})}  # what ``{}`` admits

_OBJECT = frozenset({"type", "properties", "required", "additionalProperties"})
_ARRAY = frozenset({"type", "items", "prefixItems", "minItems", "maxItems", "uniqueItems"})
_STRING = frozenset({"type", "minLength", "maxLength", "format", "pattern"})
_INTEGER = frozenset({"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
MAX_BOUND = 1e18  # integer bounds: the grammar has a few alternatives per digit


def check_schema(schema: Any, param: str) -> None:
    """Raise ``UnsupportedParameter`` (``param`` the schema's field) unless every constraint in
    ``schema`` is one the grammar enforces."""
    checker = _Checker(schema, param)
    try:
        checker.node(schema, "")
    except RecursionError:
        raise checker.refuse("", "the schema nests too deeply") from None
    except (TypeError, ValueError) as exc:  # a value of the wrong shape somewhere
        raise checker.refuse("", f"the schema cannot be read ({exc})") from None


class _Checker:
    """Walks a schema (references, unions, objects, arrays), refusing what the grammar would not
    enforce; the leaf constraints are ``_constants``, ``_integer`` and ``_string``."""

    def __init__(self, root: Any, param: str) -> None:
        self.root = root
        self.param = param
        self.refs: set[str] = set()

    def refuse(self, path: str, why: str) -> UnsupportedParameter:
        where = f"at {path}" if path else "at the schema's root"
        return UnsupportedParameter(f"{self.param}: {why} ({where})", param=self.param)

    def node(self, node: Any, path: str) -> None:
        if not isinstance(node, Mapping):
            raise self.refuse(
                path, "a schema must be a JSON object (boolean schemas are not supported)"
            )
        keys = set(node) - ANNOTATIONS
        if "$ref" in node:
            self._only(node, path, {"$ref"})
            self.node(self.resolve(node["$ref"], path), path)
        elif "anyOf" in node or "oneOf" in node:
            self._union(node, path)
        elif isinstance(node.get("type"), list):
            self._only(node, path, {"type"})
            types = node["type"]
            names = {t for t in types if isinstance(t, str)}
            if not types or len(names) != len(types) or not names <= TYPES:
                raise self.refuse(path, f"type must list distinct names of {sorted(TYPES)}")
        elif "const" in node or "enum" in node:
            self._only(node, path, {"type", "const", "enum"})
            _constants(node, path, self.refuse)
        elif "allOf" in node:
            self._all_of(node, path)
        else:
            self._typed(node, keys, path)

    def resolve(self, ref: Any, path: str) -> Any:
        """The target of a local ``$ref`` (``#/$defs/Name``), checked once however often used."""
        if not isinstance(ref, str) or not ref.startswith("#/") or "~" in ref or "%" in ref:
            raise self.refuse(path, f"$ref {ref!r}: only this schema's own #/... references")
        target = self.root
        for part in ref[2:].split("/"):
            if not isinstance(target, Mapping) or part not in target:
                raise self.refuse(path, f"$ref {ref!r} names nothing in the schema")
            target = target[part]
        if ref in self.refs:
            return {}  # already checked (or being checked: a recursive schema)
        self.refs.add(ref)
        return target

    def _only(self, node: Mapping[str, Any], path: str, allowed: set[str] | frozenset[str]) -> None:
        extra = sorted(set(node) - ANNOTATIONS - allowed)
        if extra:
            raise self.refuse(
                path, f"{extra[0]!r} is not supported here (the grammar would not enforce it)"
            )

    def _union(self, node: Mapping[str, Any], path: str) -> None:
        if "anyOf" in node and "oneOf" in node:
            raise self.refuse(path, "anyOf and oneOf together are not supported")
        key = "anyOf" if "anyOf" in node else "oneOf"
        self._only(node, path, {key})
        alternatives = node[key]
        if not isinstance(alternatives, list) or not alternatives:
            raise self.refuse(path, f"{key} must be a non-empty list of schemas")
        for i, alternative in enumerate(alternatives):
            self.node(alternative, f"{path}/{key}/{i}")
        if key == "oneOf" and len(alternatives) > 1 and not self._discriminated(alternatives):
            raise self.refuse(
                path,
                "oneOf is supported for discriminated unions only (each alternative an object "
                "with a required property whose const differs); use anyOf",
            )

    def _discriminated(self, alternatives: list[Any]) -> bool:
        objects = [self._target(a) for a in alternatives]
        if not all(isinstance(o.get("properties"), Mapping) for o in objects):
            return False
        for name in objects[0]["properties"]:
            values = []
            for o in objects:
                prop = self._target(o["properties"].get(name, {}))
                enum = prop.get("enum")
                if name not in o.get("required", []):
                    break
                if "const" in prop:
                    values.append(prop["const"])
                elif isinstance(enum, list) and len(enum) == 1:
                    values.append(enum[0])
                else:
                    break
            else:
                if all(values.count(v) == 1 for v in values):
                    return True
        return False

    def _target(self, node: Any) -> Mapping[str, Any]:
        """``node``, or what its ``$ref`` names (already checked), without marking it seen."""
        for _ in range(64):
            if not isinstance(node, Mapping) or "$ref" not in node:
                break
            target: Any = self.root
            for part in str(node["$ref"])[2:].split("/"):
                target = target.get(part, {}) if isinstance(target, Mapping) else {}
            node = target
        return node if isinstance(node, Mapping) else {}

    def _all_of(self, node: Mapping[str, Any], path: str) -> None:
        self._only(node, path, {"allOf", "type"})
        if node.get("type", "object") != "object" or not isinstance(node["allOf"], list):
            raise self.refuse(path, "allOf is supported for a list of object schemas only")
        names: set[str] = set()
        for i, part in enumerate(node["allOf"]):
            where = f"{path}/allOf/{i}"
            target = self._target(part)
            if "$ref" in part:
                self.node(part, where)
            self._only(target, where, {"type", "properties", "required"})
            if target.get("type", "object") != "object":
                raise self.refuse(where, "allOf is supported for object schemas only")
            properties = target.get("properties", {})
            if not isinstance(properties, Mapping) or names & set(properties):
                raise self.refuse(where, "allOf parts must have distinct properties")
            names |= set(properties)
            if "$ref" not in part:
                self._object(target, where)

    def _typed(self, node: Mapping[str, Any], keys: set[str], path: str) -> None:
        kind = node.get("type")
        if kind is not None and (not isinstance(kind, str) or kind not in TYPES):
            raise self.refuse(path, f"type {kind!r} is not one of {sorted(TYPES)}")
        if kind == "object" or (kind is None and keys & (_OBJECT - {"type"})):
            self._only(node, path, _OBJECT)
            self._object(node, path)
        elif kind == "array" or (kind is None and keys & (_ARRAY - {"type"})):
            self._only(node, path, _ARRAY)
            self._array(node, path)
        elif kind == "string":
            self._only(node, path, _STRING)
            _string(node, path, self.refuse)
        elif kind is None and keys & _STRING:
            raise self.refuse(path, f"{sorted(keys & _STRING)[0]!r} needs type 'string'")
        elif kind == "integer":
            self._only(node, path, _INTEGER)
            _integer(node, path, self.refuse)
        else:
            self._only(node, path, {"type"})

    def _object(self, node: Mapping[str, Any], path: str) -> None:
        properties = node.get("properties", {})
        if not isinstance(properties, Mapping):
            raise self.refuse(path, "properties must be an object")
        for name, schema in properties.items():
            self.node(schema, f"{path}/properties/{name}")
        required = node.get("required", [])
        if not isinstance(required, list) or len(
            {r for r in required if isinstance(r, str)}
        ) != len(required):
            raise self.refuse(path, "required must be a list of distinct names")
        missing = [name for name in required if name not in properties]
        if missing:
            raise self.refuse(path, f"required names {missing[0]!r}, which properties lacks")
        extra = node.get("additionalProperties")
        if extra is not None and not isinstance(extra, bool):
            self.node(extra, f"{path}/additionalProperties")

    def _array(self, node: Mapping[str, Any], path: str) -> None:
        if node.get("uniqueItems", False) is not False:
            raise self.refuse(path, "uniqueItems is not supported")
        low, high = (
            _count(self.refuse, node, "minItems", path),
            _count(self.refuse, node, "maxItems", path),
        )
        # prefixItems, or the tuple form of items (a list, before draft 2020-12): exactly those.
        tuple_key = "prefixItems" if "prefixItems" in node else "items"
        if tuple_key == "prefixItems" or isinstance(node.get("items"), list):
            prefix = node[tuple_key]
            rest = node.get("items", False) if tuple_key == "prefixItems" else False
            if not isinstance(prefix, list) or not prefix or rest is not False:
                raise self.refuse(
                    path, f"{tuple_key} must be a non-empty list, items absent or false"
                )
            if not (low or 0) <= len(prefix) <= (len(prefix) if high is None else high):
                raise self.refuse(path, f"minItems/maxItems must admit exactly the {tuple_key}")
            for i, item in enumerate(prefix):
                self.node(item, f"{path}/{tuple_key}/{i}")
        elif "items" in node:
            if low is not None and high is not None and low > high:
                raise self.refuse(path, "minItems is above maxItems")
            self.node(node["items"], f"{path}/items")
        elif low is not None or high is not None:
            raise self.refuse(path, "minItems/maxItems need items")


# The leaf checks (constants, integer bounds, strings) refuse through the walk's ``refuse``.
Refuse = Callable[[str, str], UnsupportedParameter]


def _constants(node: Mapping[str, Any], path: str, refuse: Refuse) -> None:
    if "const" in node and "enum" in node:
        raise refuse(path, "const and enum together are not supported")
    values = [node["const"]] if "const" in node else node["enum"]
    if not isinstance(values, list) or not values:
        raise refuse(path, "enum must be a non-empty list")
    kind = node.get("type")
    if kind is not None and not all(_is_type(v, kind) for v in values):
        raise refuse(path, f"a const or enum value is not of type {kind!r}")


def _integer(node: Mapping[str, Any], path: str, refuse: Refuse) -> None:
    for key in sorted((_INTEGER - {"type"}) & set(node)):
        value = node[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise refuse(f"{path}/{key}", f"{key} must be a number")
        if not abs(value) <= MAX_BOUND:
            raise refuse(f"{path}/{key}", f"{key} must be within ±{MAX_BOUND:.0e}")
    low, high = int_range.bounds(dict(node))
    if low is not None and high is not None and low > high:
        raise refuse(path, f"no integer is at least {low} and at most {high}")


def _string(node: Mapping[str, Any], path: str, refuse: Refuse) -> None:
    low, high = _count(refuse, node, "minLength", path), _count(refuse, node, "maxLength", path)
    if "pattern" in node:
        if not isinstance(node["pattern"], str):
            raise refuse(path, "pattern must be a string")
        if {"format", "minLength", "maxLength"} & set(node):
            raise refuse(path, "pattern with format, minLength or maxLength is not supported")
        try:
            pattern_gbnf(node["pattern"])
        except PatternError as exc:
            raise refuse(path, f"pattern {node['pattern']!r}: {exc}") from None
    if "format" in node:
        if not isinstance(node["format"], str) or node["format"] not in FORMATS:
            raise refuse(path, f"format {node['format']!r} is not one of {sorted(FORMATS)}")
        if low is not None or high is not None:
            raise refuse(path, "format with minLength/maxLength is not supported")
    if low is not None and high is not None and low > high:
        raise refuse(path, "minLength is above maxLength")


def _count(refuse: Refuse, node: Mapping[str, Any], key: str, path: str) -> int | None:
    value = node.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise refuse(path, f"{key} must be an integer from 0 to {MAX_COUNT}")
    return value


def _is_type(value: Any, kind: Any) -> bool:
    checks = {
        "string": isinstance(value, str),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
    }
    return checks.get(kind, False) if isinstance(kind, str) else False


def normalized(schema: Any) -> Any:
    """A copy in which ``items: {}`` reads as any value (the converter writes an object for an
    empty schema, and skips an empty ``items`` altogether)."""
    if isinstance(schema, list):
        return [normalized(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: normalized(v) for k, v in schema.items()}
    if out.get("items") == {}:
        out["items"] = dict(ANY_VALUE)
    return out
