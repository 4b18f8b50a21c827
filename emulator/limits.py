"""SageMaker Runtime's input constraints as AWS enforces them, read from botocore's own service model
(``sagemaker-runtime``: each header member's ``pattern``, ``min``, ``max`` and ``enum``), not copied
here by hand. botocore sends whatever it is given (it checks no pattern and no maximum); AWS refuses
it with a ``ValidationError`` worded as below, so the local front refuses it the same way.

The model's patterns are Java regular expressions, matched against the whole value (a name with an
underscore fails ``^[a-zA-Z0-9](-*[a-zA-Z0-9])*`` on AWS, although the pattern has no ``$``),
translated by ``infra.patterns`` (shared with ``arbiter transform --aws``'s checks). A pattern with
an untranslated construct stops the front at start-up rather than being guessed at.

Limits the model does not carry are SageMaker's documented ones: 6 MB real-time payloads each way
(the model's ``BodyBlob`` max, also applied to the container's answer), 128,000 bytes of inline async
body and 1 GB of async input (the developer guide).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from emulator.errors import ValidationError
from infra.patterns import compiled

MAX_REALTIME_BYTES = 6_291_456  # BodyBlob's max: requests and responses, InvokeEndpoint
MAX_ASYNC_INPUT_BYTES = 1024**3  # Asynchronous Inference: "payload sizes up to 1 GB"


@dataclass(frozen=True)
class Rule:
    """One modelled member: where it travels and what it may hold."""

    member: str  # the API's name, e.g. CustomAttributes
    location: str  # "header" or "uri"
    wire_name: str  # the header name (or the URI label)
    type_name: str  # "string", "integer", "blob"
    minimum: int | None
    maximum: int | None
    pattern: str | None
    enum: tuple[str, ...]
    sensitive: bool

    def problems(self, value: str) -> list[str]:
        """AWS's constraint messages that ``value`` (as it arrived) breaks."""
        field = self.member[0].lower() + self.member[1:]
        shown = "***" if self.sensitive else value
        at = f"Value '{shown}' at '{field}' failed to satisfy constraint: Member must"
        if self.type_name == "integer":
            try:
                number = int(value.strip())
            except ValueError:
                return [f"{at} be an integer"]
            found = []
            if self.minimum is not None and number < self.minimum:
                found.append(f"{at} have value greater than or equal to {self.minimum}")
            if self.maximum is not None and number > self.maximum:
                found.append(f"{at} have value less than or equal to {self.maximum}")
            return found
        found = []
        if self.minimum is not None and len(value) < self.minimum:
            found.append(f"{at} have length greater than or equal to {self.minimum}")
        if self.maximum is not None and len(value) > self.maximum:
            found.append(f"{at} have length less than or equal to {self.maximum}")
        if self.pattern is not None and not compiled(self.pattern).fullmatch(value):
            found.append(f"{at} satisfy regular expression pattern: {self.pattern}")
        if self.enum and value not in self.enum:
            found.append(f"{at} satisfy enum value set: [{', '.join(self.enum)}]")
        return found


@functools.cache
def service_model() -> Any:
    import botocore.session

    return botocore.session.get_session().get_service_model("sagemaker-runtime")


@functools.cache
def rules(operation: str) -> tuple[Rule, ...]:
    """The header and URI members of ``operation``'s input, with their constraints."""
    shape = service_model().operation_model(operation).input_shape
    found = []
    for name, member in shape.members.items():
        location = member.serialization.get("location")
        if location not in ("header", "uri"):
            continue
        meta = member.metadata
        rule = Rule(
            member=name,
            location=location,
            wire_name=member.serialization.get("name", name),
            type_name=member.type_name,
            minimum=meta.get("min"),
            maximum=meta.get("max"),
            pattern=meta.get("pattern"),
            enum=tuple(getattr(member, "enum", None) or ()),
            sensitive=bool(meta.get("sensitive")),
        )
        if rule.pattern is not None:
            compiled(rule.pattern)  # an untranslatable pattern fails here, at start-up
        found.append(rule)
    return tuple(found)


def body_maximum(operation: str) -> int | None:
    """The modelled maximum of the operation's ``Body`` (6 MB real-time, 128,000 async)."""
    body = service_model().operation_model(operation).input_shape.members.get("Body")
    return None if body is None else body.metadata.get("max")


def output_body_maximum(operation: str) -> int | None:
    return output_maximum(operation, "Body")


def output_maximum(operation: str, member: str) -> int | None:
    """The modelled maximum of an output member (``CustomAttributes``: 1,024 characters)."""
    shape = service_model().operation_model(operation).output_shape.members.get(member)
    return None if shape is None else shape.metadata.get("max")


def check(operation: str, headers: Mapping[str, str], uri: Mapping[str, str]) -> None:
    """Refuse the call as AWS would: one ValidationError listing every broken constraint."""
    problems: list[str] = []
    for rule in rules(operation):
        source = headers if rule.location == "header" else uri
        value = source.get(rule.wire_name)
        if value is not None:
            problems += rule.problems(value)
    if problems:
        count = len(problems)
        noun = "validation error" if count == 1 else "validation errors"
        raise ValidationError(f"{count} {noun} detected: " + "; ".join(problems))
