"""A transform job's ``DataProcessing``: ``InputFilter``, ``JoinSource`` and ``OutputFilter`` over
JSON Lines records, as SageMaker's "Associate Prediction Results with Input Records" guide says.

Per record (a line): ``InputFilter`` selects what the container is sent; its answer (one line per
record, in order) is joined to the *unfiltered* record when ``JoinSource=Input`` (an object gets a
``SageMakerOutput`` member; anything else becomes ``{"SageMakerInput": ..., "SageMakerOutput":
...}``); ``OutputFilter`` selects what is written, from the joined record (or from the answer alone
without a join).

The expressions are parsed by python-jsonpath (RFC 9535) and then held to SageMaker's subset:
``$`` first, then only ``.name``, ``*``, ``['a','b']``, ``[n]``/``[n,m]`` (negative too) and
``[start:end]`` segments (``$.a.['b','c']`` is read as ``$.a['b','c']``, as the guide writes it);
recursive descent, filters, steps and unions are refused before anything runs. The results are
shaped as SageMaker's JsonPath (Jayway) shapes them: a path of names and single indexes gives its
value (nothing there is an error); one ending in several names gives an object of those present;
any other gives the list of what it matched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonpath
from jsonpath.segments import JSONPathChildSegment
from jsonpath.selectors import IndexSelector, NameSelector, SliceSelector, WildcardSelector

from infra.transform import TransformError, TransformJob

OPERATORS = "$, .name, *, ['name','name'], [n,n] (negative too), [start:end]"
JSON_CONTENT = ("application/json", "application/jsonlines")


class RecordFailed(Exception):
    """A record cannot be filtered or joined; the message says which and why."""


@dataclass(frozen=True)
class Filter:
    """One compiled InputFilter or OutputFilter."""

    name: str
    text: str
    path: Any  # jsonpath.JSONPath; None for "$"
    shape: str  # "whole", "value", "object" or "list"

    def apply(self, value: Any) -> Any:
        if self.path is None:
            return value
        if self.shape == "list":
            return self.path.findall(value)
        found = list(self.path.finditer(value))
        if self.shape == "object":
            return {match.parts[-1]: match.obj for match in found}
        if not found:
            raise RecordFailed(f"{self.name} {self.text!r} selects nothing in the record")
        return found[0].obj


def compile_filter(name: str, text: str | None) -> Filter:
    """``text`` parsed and held to SageMaker's JSONPath subset; TransformError otherwise."""
    if text is None or text.strip() in ("", "$"):
        return Filter(name, "$", None, "whole")
    refused = f"{name} {text!r} is not in SageMaker's JSONPath subset ({OPERATORS})"
    if not text.startswith("$"):
        raise TransformError(f"{refused}: it starts with $")
    try:
        path = jsonpath.compile(text.replace(".[", "["))
    except jsonpath.JSONPathError as exc:
        raise TransformError(f"{refused}: {str(exc).splitlines()[0]}") from exc
    if not isinstance(path, jsonpath.JSONPath):  # a union or an intersection of paths
        raise TransformError(refused)
    allowed = (NameSelector, IndexSelector, SliceSelector, WildcardSelector)
    for segment in path.segments:
        if not isinstance(segment, JSONPathChildSegment):
            raise TransformError(f"{refused}: no recursive descent (..)")
        for selector in segment.selectors:
            if not isinstance(selector, allowed):
                raise TransformError(f"{refused}: no {type(selector).__name__}")
            if isinstance(selector, SliceSelector) and selector.slice.step not in (None, 1):
                raise TransformError(f"{refused}: a slice has no step")
    return Filter(name, text, path, _shape(path))


def _shape(path: Any) -> str:
    *parents, last = [segment.selectors for segment in path.segments]
    single = (NameSelector, IndexSelector)
    if all(len(s) == 1 and isinstance(s[0], single) for s in parents):
        if len(last) == 1 and isinstance(last[0], single):
            return "value"
        if len(last) > 1 and all(isinstance(s, NameSelector) for s in last):
            return "object"
    return "list"


@dataclass(frozen=True)
class DataProcessing:
    input_filter: Filter
    output_filter: Filter
    join: bool

    @property
    def active(self) -> bool:
        return (
            self.join or self.input_filter.path is not None or self.output_filter.path is not None
        )

    @classmethod
    def of(cls, job: TransformJob) -> DataProcessing:
        """The job's, compiled; what this emulator cannot do is refused before anything runs."""
        processing = cls(
            compile_filter("InputFilter", job.input_filter),
            compile_filter("OutputFilter", job.output_filter),
            job.join_source == "Input",
        )
        if processing.active:
            if job.split_type != "Line":
                raise TransformError(
                    "DataProcessing applies per record here: SplitType=Line (a record is a line)"
                )
            types = {job.content_type, job.accept}
            if not types <= set(JSON_CONTENT):
                raise TransformError(
                    "DataProcessing here reads and writes JSON records: ContentType and Accept "
                    f"are {' or '.join(JSON_CONTENT)} (text/csv is not built)"
                )
        return processing

    def request_line(self, line: bytes, number: int) -> bytes:
        """What the container is sent for the record ``line`` (its newline kept)."""
        if self.input_filter.path is None:
            return line
        selected = self.input_filter.apply(_parsed(line, number, "input record"))
        return _dumped(selected) + b"\n"

    def output_line(self, record: bytes, answer: bytes, number: int) -> bytes:
        """What is written for ``record`` and its ``answer`` (no newline)."""
        value = _parsed(answer, number, "answer") if self.join or self.output_filter.path else None
        if self.join:
            original = _parsed(record, number, "input record")
            if isinstance(original, dict):
                value = {**original, "SageMakerOutput": value}
            else:
                value = {"SageMakerInput": original, "SageMakerOutput": value}
        if value is None:
            return answer.rstrip(b"\r\n")
        return _dumped(self.output_filter.apply(value))


def _parsed(line: bytes, number: int, what: str) -> Any:
    try:
        return json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordFailed(
            f"the {what} of record {number} is not JSON, so DataProcessing cannot apply ({exc})"
        ) from exc


def _dumped(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
