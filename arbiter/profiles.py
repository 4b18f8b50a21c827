"""Prompt profiles: the instruction, the content layout, the labels and the answer cue of a decision
prompt, in a small versioned TOML file, so a fine-tuned model reads the format it was trained on.

``ARBITER_PROMPT_PROFILE`` names a built-in (``arbiter-letters-v1``, the default: Arbiter's own
prompt, byte for byte) or a path to a file such as::

    format = 1
    name = "triage-yes-no-v3"
    instruction = "Answer the question about the ticket with yes or no."
    labels = ["yes", "no"]
    state = "Ticket:\\n{{ state }}\\n\\n"
    question = "{{ question }}\\n{% for o in options %}- {{ o.label }}: {{ o.text }}\\n{% endfor %}"
    [answer_cue]
    plain = "Answer:"

``state`` and ``question`` are Jinja templates rendered in the immutable sandbox with undefined
names refused; ``state`` sees the state text, ``question`` the question, ``options`` (each with its
``label`` and ``text``), ``labels`` and ``codes``. The state part comes first, so every question
about one state shares its tokens. The file's sha256 is reported with every result.
"""

from __future__ import annotations

import functools
import hashlib
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from arbiter.errors import ModelLoadError
from arbiter.models import ResolvedModel, verify_attachment
from arbiter.schema import MAX_OPTIONS

DEFAULT_PROFILE = "arbiter-letters-v1"
BUILTINS = (DEFAULT_PROFILE,)
MAX_LABELS = 255


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    return ImmutableSandboxedEnvironment(
        keep_trailing_newline=True, undefined=jinja2.StrictUndefined, autoescape=False
    )


def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"not a valid template (line {exc.lineno}: {exc.message})") from None


class AnswerCue(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    plain: str = Field(default="", description="After the question, for a plain (no chat) prompt.")
    chat: str = Field(default="", description="After the chat template's generation prompt.")


class PromptProfile(BaseModel):
    """A profile file, validated (``format`` 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal[1]
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    codes_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    instruction: str = Field(min_length=1)
    codes_instruction: str | None = Field(default=None, min_length=1)
    labels: Literal["letters", "digits"] | tuple[str, ...]
    state: str
    question: str
    answer_cue: AnswerCue = AnswerCue()

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: str | tuple[str, ...]) -> str | tuple[str, ...]:
        if isinstance(value, str):
            return value
        if not 2 <= len(value) <= MAX_LABELS:
            raise ValueError(f"a label list has 2 to {MAX_LABELS} labels")
        for label in value:
            if not label or label != label.strip():
                raise ValueError(f"label {label!r} is empty or has spaces around it")
        if len(set(value)) != len(value):
            raise ValueError("labels must be distinct")
        return value

    @field_validator("state", "question")
    @classmethod
    def _template(cls, value: str) -> str:
        _compile(value)
        return value


@dataclass(frozen=True)
class Profile:
    """A loaded profile: what it says, where it came from, its sha256 and its compiled parts."""

    spec: PromptProfile
    source: str  # "builtin:<name>" or the file's path
    sha256: str
    state_template: jinja2.Template
    question_template: jinja2.Template

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def codes_name(self) -> str:
        return self.spec.codes_name or f"{self.spec.name}-codes"

    @property
    def positional_labels(self) -> bool:
        """Whether the labels only say where an option sits (letters, digits), so an option may
        be shown under any of them. A profile's own words (``yes``/``no``) mean something next
        to the question: its options are read in the order given (``rotation``)."""
        return isinstance(self.spec.labels, str)

    @property
    def builtin(self) -> bool:
        return self.source.startswith("builtin:")

    def version(self, codes: bool) -> str:
        """The name a result's ``prompt.version`` reports: a built-in's own, a file's with its
        sha256 (``ticket-yes-no-v1@3f2a9c1b7d4e``), so a file named like a built-in, or an edited
        file that kept its name, never reports the same version."""
        name = self.codes_name if codes else self.name
        return name if self.builtin else f"{name}@{self.sha256[:12]}"

    def instruction(self, codes: bool) -> str:
        if codes and self.spec.codes_instruction:
            return self.spec.codes_instruction
        return self.spec.instruction

    def state(self, state: str) -> str:
        return self.state_template.render(state=state)

    def question(
        self, question: str, descriptions: list[str], labels: list[str], codes: bool
    ) -> str:
        options = [{"label": lb, "text": t} for lb, t in zip(labels, descriptions, strict=True)]
        return self.question_template.render(
            question=question, options=options, labels=labels, codes=codes
        )


def parse_profile(data: bytes, source: str) -> Profile:
    """A profile from a file's bytes; ``ModelLoadError`` in one line naming what is wrong."""
    where = f"prompt profile {source}"
    try:
        raw: dict[str, Any] = tomllib.loads(data.decode("utf-8"))
        spec = PromptProfile.model_validate(raw)
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{where} is not UTF-8 text: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ModelLoadError(f"{where} is not valid TOML: {exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "the file"
        raise ModelLoadError(f"{where}: {field}: {first['msg']}") from None
    profile = Profile(
        spec,
        source,
        hashlib.sha256(data).hexdigest(),
        _compile(spec.state),
        _compile(spec.question),
    )
    _probe(profile, where)
    return profile


def _probe_counts(spec: PromptProfile) -> list[tuple[int, bool]]:
    """The option counts a profile is rendered with at load, with whether they are codes: two,
    three and the most its labels label (a template that failed only past two options passed the
    old probe of two, then failed every larger decision with a traceback in the log)."""
    if spec.labels == "letters":
        return [(2, False), (3, False), (26, False), (27, True), (MAX_OPTIONS, True)]
    most = 9 if spec.labels == "digits" else len(spec.labels)
    return [(n, False) for n in sorted({2, min(3, most), most})]


def _probe(profile: Profile, where: str) -> None:
    """Render made-up decisions once (each count of ``_probe_counts``), so a template that cannot
    render, or one that drops the state, the question or an option, stops start-up instead of a
    request."""
    state, question = "\u0001STATE\u0001", "\u0001QUESTION\u0001"
    try:
        state_part = profile.state(state)
    except jinja2.TemplateError as exc:
        raise ModelLoadError(f"{where}: a template does not render: {exc}") from None
    if state_part.count(state) != 1:
        raise ModelLoadError(f"{where}: state must place {{{{ state }}}} exactly once")
    for n, codes in _probe_counts(profile.spec):
        texts = [f"\u0001OPTION-{i}\u0001" for i in range(n)]
        labels = [f"\u0002L{i}\u0002" for i in range(n)]
        try:
            question_part = profile.question(question, texts, labels, codes)
        except Exception as exc:  # a template error, or one of its own (an index, a type)
            raise ModelLoadError(
                f"{where}: the question template does not render {n} options: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        needles = ((question, "the question"), *((t, "each option's text") for t in texts))
        for needle, what in needles:
            if question_part.count(needle) != 1:
                raise ModelLoadError(
                    f"{where}: question must place {what} exactly once ({n} options)"
                )
        if any(label not in question_part for label in labels):
            raise ModelLoadError(f"{where}: question must show each option's label ({n} options)")


def builtin_bytes(name: str) -> bytes:
    return resources.files("arbiter").joinpath("data", f"{name}.toml").read_bytes()


def resolve_profile(setting: str | None, resolved: ResolvedModel) -> Profile:
    """The served profile: ``ARBITER_PROMPT_PROFILE``, else the one the model's manifest packs
    (its sha256 checked), else the default."""
    if setting is not None:
        return load_profile(setting)
    if resolved.profile is not None:
        verify_attachment(resolved.profile, "prompt profile")
        return load_profile(resolved.profile.path)
    return load_profile(None)


def load_profile(value: str | Path | None) -> Profile:
    """The profile ``ARBITER_PROMPT_PROFILE`` names: a built-in name, a path, or the default."""
    if value is None or str(value) in BUILTINS:
        name = DEFAULT_PROFILE if value is None else str(value)
        return parse_profile(builtin_bytes(name), f"builtin:{name}")
    path = Path(value)
    try:
        data = path.read_bytes()
    except OSError as exc:
        known = ", ".join(BUILTINS)
        raise ModelLoadError(
            f"prompt profile {path}: cannot read it ({exc.strerror or exc}); give a path to a "
            f"profile file or a built-in name ({known})"
        ) from None
    return parse_profile(data, str(path))
