"""AWS service models' patterns (Java regular expressions) as Python ones.

botocore checks no pattern before it sends; AWS does, matching the whole value (Java's
``matches()``: ``my_model`` fails ``[a-zA-Z0-9]([\\-a-zA-Z0-9]*[a-zA-Z0-9])?`` although the pattern has
no ``$``). Both the local runtime front (``emulator.limits``) and ``arbiter transform --aws``'s check
of its requests (``infra.transform``) read them here, translated: ``\\p{ASCII}`` (``\\x00-\\x7F``),
``\\p{Print}`` (Java's POSIX class, ASCII only: ``\\x20-\\x7E``), ``\\z`` (``\\Z``), and ``.``, which in Java
matches no line terminator (``\\n``, ``\\r``, U+0085, U+2028, U+2029): a content type with a newline
fails ``.*`` on AWS. Any other ``\\p{...}`` raises rather than being guessed at.
"""

from __future__ import annotations

import functools
import re

_JAVA_CLASSES = {"ASCII": r"\x00-\x7F", "Print": r"\x20-\x7E"}
_PROPERTY = re.compile(r"\\p\{(\w+)\}")
_JAVA_DOT = "[^\\n\\r\\x85\\u2028\\u2029]"


def java_pattern(pattern: str) -> re.Pattern[str]:
    """A model pattern as a Python regular expression (to be used with ``fullmatch``)."""

    def translate(text: str) -> str:
        out, i, in_class = [], 0, False
        while i < len(text):
            found = _PROPERTY.match(text, i)
            if found:
                name = found.group(1)
                if name not in _JAVA_CLASSES:
                    raise ValueError(f"pattern {pattern!r}: \\p{{{name}}} is not translated")
                chars = _JAVA_CLASSES[name]
                out.append(chars if in_class else f"[{chars}]")
                i = found.end()
                continue
            if text.startswith(r"\z", i):
                out.append(r"\Z")
                i += 2
                continue
            if text[i] == "\\":
                out.append(text[i : i + 2])
                i += 2
                continue
            if text[i] == "." and not in_class:
                out.append(_JAVA_DOT)
                i += 1
                continue
            if text[i] == "[" and not in_class:
                in_class = True
            elif text[i] == "]" and in_class:
                in_class = False
            out.append(text[i])
            i += 1
        return "".join(out)

    return re.compile(translate(pattern))


@functools.cache
def compiled(pattern: str) -> re.Pattern[str]:
    return java_pattern(pattern)
