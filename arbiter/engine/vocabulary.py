"""A model's vocabulary through llama.cpp's C API: text to tokens as a prompt holds them, and each
token's bytes. Its calls take a lock of their own (``llama_tokenize`` releases the GIL, and
chat prompts are tokenized outside the engine lock), which :class:`~arbiter.engine.llama.Llama`'s
``close`` takes too, so the vocabulary is never freed under a running call."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from arbiter.errors import EngineFailure, InvalidDecision, ModelLoadError

# SentencePiece and byte-level BPE: every input byte ends up in some token's piece (no normalizer
# drops or folds characters), so a token never covers more input bytes than its piece holds.
_BYTE_PRESERVING = {1, 2}  # LLAMA_VOCAB_TYPE_SPM, LLAMA_VOCAB_TYPE_BPE
# Tokens after which llama.cpp writes a SentencePiece vocabulary's space prefix again (its special
# tokens cache: control, user-defined and unknown tokens).
_OPENS_TEXT = (
    llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
)
# Put before a piece that continues a prompt and taken off again (``Vocabulary.tokenize``): the first
# whose own tokens end where the piece's begin, and whose last token is not one after which llama.cpp
# writes the space prefix again.
_LEADS = ("\n", "\u0001", "~")


class Vocabulary:
    """The vocabulary of a loaded model (``handle``: its ``llama_vocab``)."""

    def __init__(self, handle: Any, path: Path, lock: threading.Lock) -> None:
        self.handle = handle
        self.lock = lock  # the model's: closing it waits for a call in progress
        self.closed = False
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(handle))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(handle))
        self.bos = int(llama_cpp.llama_vocab_bos(handle))
        self.eos = int(llama_cpp.llama_vocab_eos(handle))
        if self.add_bos and not 0 <= self.bos < self.n_vocab:
            raise ModelLoadError(
                f"{path.name}: the vocabulary asks for a BOS token but has none "
                f"(token id {self.bos}); refusing to start"
            )
        # SentencePiece's add_space_prefix (Llama 2, Mistral v0.1-v0.3, Phi-3, Baichuan, Yi):
        # "A" is "▁A", written at the start of each text llama.cpp tokenizes.
        first = self._tokens("a", special=False)
        self.space_prefix = b"".join(self.piece_bytes(int(t)) for t in first).startswith(b" ")

    def check_open(self) -> None:
        if self.closed:
            raise EngineFailure("the engine is closed (the server is shutting down)")

    # -- tokens ------------------------------------------------------------------------------------

    def tokenize(self, text: str, *, special: bool, after: int | None = None) -> np.ndarray:
        """Tokens of ``text``, in a buffer of this call's own; ``after``: the token it follows in
        a prompt (None: it starts one).

        A vocabulary with a space prefix gets it where llama.cpp writes it in a whole prompt: at
        the start and after a special token, never where a piece continues text (tokenized apart,
        each piece had its own ``▁``: 23 tokens for a prompt of 22). ``llama_tokenize`` releases
        the GIL: a buffer shared between calls let a concurrent tokenization (chat prompts are
        tokenized outside the engine lock) overwrite another's tokens, and a decision was scored
        on the wrong prompt.
        """
        if after is None or self.opens_text(after):
            return self._tokens(text, special)
        return self.continued(text, special=special)

    def continued(self, text: str, *, special: bool) -> np.ndarray:
        """Tokens of ``text`` where it continues a prompt's text (no space prefix of its own):
        what the model reads, and writes, after other text."""
        if not self.space_prefix:
            return self._tokens(text, special)
        for lead in _LEADS:
            own = self._tokens(lead, False)
            if len(own) and self.opens_text(int(own[-1])):
                continue  # a user-defined "\n" (Gemma's): the text after it is prefixed again
            both = self._tokens(lead + text, special)
            if np.array_equal(both[: len(own)], own):
                return both[len(own) :]
        return self._tokens(text, special)

    def encode_segments(self, segments: Sequence[tuple[str, bool]]) -> np.ndarray:
        """Tokens of a rendered chat prompt given as (text, is_template) pieces, in order.

        Template text is tokenized with special-token parsing; caller text without it, so a
        message can never inject a control token. Each piece after the first is tokenized where
        it follows the one before (:meth:`tokenize`'s ``after``: no space prefix of its own).
        BOS is added if the model wants one and the template did not write it.
        """
        parts: list[np.ndarray] = []
        after: int | None = None
        for text, special in segments:
            if text:
                parts.append(self.tokenize(text, special=special, after=after))
                after = int(parts[-1][-1]) if len(parts[-1]) else after
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        if self.add_bos and (len(tokens) == 0 or tokens[0] != self.bos):
            tokens = np.concatenate([np.array([self.bos], dtype=np.int32), tokens])
        return tokens.astype(np.int32)

    def opens_text(self, token: int) -> bool:
        """Whether llama.cpp starts a new text after ``token`` (a special token: the space
        prefix is written again after it)."""
        if not 0 <= token < self.n_vocab:
            return True
        with self.lock:
            self.check_open()
            return bool(llama_cpp.llama_vocab_get_attr(self.handle, token) & _OPENS_TEXT)

    def _tokens(self, text: str, special: bool) -> np.ndarray:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidDecision(
                f"the text is not valid Unicode ({exc.reason} at character {exc.start})",
                code="invalid_text",
            ) from exc
        # A token covers at least one byte; the margin covers a leading-space marker.
        buf = np.empty(len(data) + 16, dtype=np.int32)
        with self.lock:
            self.check_open()
            n = self._tokenize_into(data, buf, special)
            if n < 0:
                buf = np.empty(-n, dtype=np.int32)
                n = self._tokenize_into(data, buf, special)
        if n < 0:
            raise EngineFailure(f"llama_tokenize failed with status {n}")
        return buf[:n].copy()

    def _tokenize_into(self, data: bytes, buf: np.ndarray, special: bool) -> int:
        out = buf.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        return int(
            llama_cpp.llama_tokenize(self.handle, data, len(data), out, len(buf), False, special)
        )

    def max_piece_bytes(self) -> int:
        """The most bytes one token of caller text can cover (``engine.cost``); 0 for a
        tokenizer that normalizes text (it may drop bytes, so no floor holds)."""
        if int(llama_cpp.llama_vocab_type(self.handle)) not in _BYTE_PRESERVING:
            return 0
        longest = 0
        buf = ctypes.create_string_buffer(256)
        with self.lock:
            self.check_open()
            for token in range(self.n_vocab):
                n = llama_cpp.llama_token_to_piece(self.handle, token, buf, len(buf), 0, True)
                longest = max(longest, n if n >= 0 else -n)  # -n: the length it would need
        return longest

    def piece_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of a token (without ``special``, control tokens render as nothing).

        llama.cpp indexes its token table unchecked (``std::out_of_range`` across ctypes aborts
        the process), so an id outside ``[0, n_vocab)`` is "" here and never reaches it.
        """
        if not 0 <= token < self.n_vocab:
            return b""
        with self.lock:
            self.check_open()
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.handle, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.handle, token, buf, len(buf), 0, special)
        return buf.raw[: max(n, 0)]

    def piece_text(self, token: int) -> str:
        """The text of one token, control tokens included ("" for an id outside the vocabulary,
        e.g. a missing BOS)."""
        return self.piece_bytes(token, special=True).decode("utf-8", "replace")

    def is_control(self, token: int) -> bool:
        if not 0 <= token < self.n_vocab:
            return False
        with self.lock:
            self.check_open()
            return bool(llama_cpp.llama_vocab_is_control(self.handle, token))

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.handle, token))

    @contextmanager
    def vocabulary(self) -> Iterator[Any]:
        """The vocabulary's handle, for the sampler module; :meth:`close` waits for the block."""
        with self.lock:
            self.check_open()
            yield self.handle
