"""Hypothesis strategies for hostile input: every JSON value Python's parser can hand us, text with
lone surrogates, control and special-token characters, and decisions that are almost valid.

``examples(n)`` scales a test's example count by ``ARBITER_FUZZ_SCALE`` (``make fuzz`` raises it).
"""

from __future__ import annotations

import json
import os
from typing import Any

from hypothesis import strategies as st

SCALE = max(1, int(os.environ.get("ARBITER_FUZZ_SCALE", "1")))


def examples(n: int) -> int:
    return n * SCALE


# Characters that have broken text handling somewhere: surrogates (legal as JSON escapes, not
# encodable as UTF-8), NUL and other controls, BOM, bidi overrides, line separators, astral
# characters, and the special-token spellings of the chat templates.
_NASTY = [
    "\ud800",
    "\udfff",
    "\ud83d",
    "\x00",
    "\x1b",
    "\r",
    "\n",
    "\t",
    "\ufeff",
    "\u202e",
    "\u2028",
    "\U0001f600",
    "\uffff",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|im_start|>",
    "<|im_end|>",
    "\u0000ArbiterText0:\u0000",
    "\u0000ArbiterText1:j\u0000",
    "{{ raise_exception('x') }}",
]

text = st.lists(st.one_of(st.characters(), st.sampled_from(_NASTY)), max_size=24).map("".join)
nonblank = st.one_of(st.sampled_from(["a", "Yes", "No", "Which one?"]), text)
numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1e-310, 1e308, 5e-324, 2**63, -(2**63) - 1, 0.01, 100.0]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, text)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


deep = st.integers(min_value=1, max_value=200).map(nested)
anything = st.one_of(json_values, deep)

# Decisions that pass the wire schema, with hostile but valid text everywhere.
valid_text = st.text(min_size=1, max_size=60).filter(lambda s: s.strip() != "")
valid_decision = st.fixed_dictionaries(
    {
        "id": st.text(min_size=1, max_size=20),
        "state": st.one_of(
            valid_text,
            st.dictionaries(
                st.text(max_size=8), st.one_of(st.text(max_size=30), st.integers()), min_size=1
            ),
        ),
        "question": valid_text,
        "options": st.lists(
            st.fixed_dictionaries(
                {"id": st.text(min_size=1, max_size=8), "description": valid_text}
            ),
            min_size=2,
            max_size=5,
            unique_by=lambda o: o["id"],
        ),
    },
    optional={
        "temperature": st.floats(min_value=0.01, max_value=100),
        "order_samples": st.integers(min_value=1, max_value=2),
    },
)

# Almost valid: a valid decision with one to three fields replaced by something hostile, so most
# of what is generated gets past the easy checks and tests the hard ones.
_hostile_state = st.one_of(
    text,
    st.dictionaries(text, st.one_of(text, numbers), min_size=1, max_size=3),
    st.lists(st.one_of(text, numbers), min_size=1, max_size=3),
    deep,
    anything,
)
_hostile_options = st.one_of(
    st.lists(st.fixed_dictionaries({"id": nonblank, "description": nonblank}), max_size=30),
    st.lists(st.fixed_dictionaries({"id": anything, "description": anything}), max_size=3),
    anything,
)
_replacements = {
    "id": st.one_of(nonblank, anything),
    "state": _hostile_state,
    "question": st.one_of(nonblank, anything),
    "options": _hostile_options,
    "temperature": st.one_of(numbers, anything),
    "order_samples": st.one_of(st.integers(min_value=-2, max_value=10), anything),
    "question_type": st.one_of(st.sampled_from(["noul", "choice", "score"]), anything),
    "surplus": anything,
}
decision_like = st.builds(
    lambda base, changes: {**base, **changes},
    valid_decision,
    st.lists(st.sampled_from(sorted(_replacements)), min_size=1, max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: _replacements[k] for k in keys})
    ),
)


def encode(value: Any) -> bytes:
    """JSON text as a hostile client would send it (surrogates escaped, NaN allowed)."""
    return json.dumps(value).encode()


# One JSON Lines input line: a decision, hostile JSON, bytes that are not UTF-8, a bracket bomb,
# or nothing at all.
jsonl_line = st.one_of(
    valid_decision.map(encode),
    st.deferred(lambda: bombs),
    decision_like.map(encode),
    anything.map(encode),
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ")),
    st.sampled_from([b"", b"   ", b"\r", b"[" * 3000, b'{"id": ' + b"9" * 5000 + b"}", b"NaN"]),
)

# JSON text no Python value can be dumped to: nesting past the recursion limit, huge integers.
bombs = st.one_of(
    st.integers(min_value=900, max_value=5000).map(
        lambda n: b'{"id": "x", "state": ' + b"[" * n + b"]" * n + b"}"
    ),
    st.integers(min_value=4301, max_value=6000).map(
        lambda n: b'{"id": "x", "temperature": ' + b"7" * n + b"}"
    ),
    st.sampled_from([b'{"id": "x", "temperature": NaN}', b'{"state": Infinity}', b"-Infinity"]),
)
