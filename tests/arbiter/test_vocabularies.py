"""Every vocabulary llama.cpp ships (issue 35): the sdist's own ``models/ggml-vocab-*.gguf``,
SentencePiece ones with ``add_space_prefix`` included (Llama 2, Mistral v0.1-v0.3, Phi-3,
Baichuan). Their labels were refused at load ("A" tokenizes as "▁A" and " A" as "▁", "▁A"), and a
prompt tokenized in pieces gave each piece its own "▁" (23 tokens for a prompt of 22).

The vocabularies are loaded alone (no weights); the engine's path (prefill, branches, readout) runs
on a random-weight Llama built over the Llama SentencePiece vocabulary with the ``gguf`` package.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from arbiter.cli import main
from arbiter.engine import Engine, open_engine
from arbiter.engine.labels import Labels
from arbiter.engine.llama import Llama
from arbiter.engine.prompting import open_prompts
from arbiter.errors import LabelVocabularyError
from arbiter.profiles import load_profile
from arbiter.prompt import LETTERS
from arbiter.schema import DecisionResult
from arbiter.settings import EngineSettings
from tests.fakes import decision, decision_body
from tests.gguf_models import Vocabulary, random_weights, sdist_vocabularies, template_text
from tests.threads import TEST_THREADS

NAMES = (
    "aquila", "baichuan", "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon",
    "gemma-4", "gpt-2", "gpt-neox", "llama-bpe", "llama-spm", "mpt", "nomic-bert-moe", "phi-3",
    "qwen2", "qwen35", "refact", "starcoder",
)  # fmt: skip
SENTENCEPIECE = {"baichuan", "llama-spm", "phi-3"}  # add_space_prefix, as llama.cpp defaults it
NO_LETTERS = {"bert-bge"}  # an uncased WordPiece vocabulary: no capital letters at all


@pytest.fixture(scope="module")
def vocabularies() -> dict[str, Path]:
    return sdist_vocabularies()


def _load(path: Path) -> Llama:
    return Llama(path, EngineSettings(model=path), vocab_only=True)


def test_the_list_is_the_sdists_vocabularies(vocabularies: dict[str, Path]) -> None:
    assert tuple(vocabularies) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_vocabulary_whose_letters_exist_loads_its_labels(
    name: str, vocabularies: dict[str, Path]
) -> None:
    llama = _load(vocabularies[name])
    try:
        pieces = {llama.vocab.piece_bytes(t) for t in range(llama.n_vocab)}
        exist = all({letter.encode(), f" {letter}".encode()} & pieces for letter in LETTERS)
        assert exist == (name not in NO_LETTERS)
        if not exist:
            with pytest.raises(LabelVocabularyError):
                Labels.of(llama)
            return
        labels = Labels.of(llama)
        assert labels.max_letters == 26 and labels.codes is not None
        spellings = ("", " ") if labels.token_ids.shape[1] == 2 else (None,)
        if name in SENTENCEPIECE:
            assert (
                llama.vocab.space_prefix and labels.token_ids.shape[1] == 2
            )  # "A" and "▁A" both kept
        for row, letter in zip(labels.token_ids, LETTERS, strict=True):
            texts = [llama.vocab.piece_bytes(int(t)).decode() for t in row]
            if spellings != (None,):
                assert texts == [lead + letter for lead in spellings]
            else:
                assert texts[0].strip() == letter
    finally:
        llama.close()


@pytest.mark.parametrize(
    ("name", "template"),
    [
        ("llama-spm", "llama-2-chat"),
        ("phi-3", None),  # its own template
        ("phi-3", "microsoft-Phi-3.5-mini-instruct"),
        ("baichuan", "vicuna-13b-1.1"),
    ],
)
def test_arbiter_prompt_on_a_sentencepiece_vocabulary_tokenizes_as_the_whole_string(
    name: str,
    template: str | None,
    vocabularies: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = vocabularies[name]
    path = source if template is None else tmp_path / f"{name}.gguf"
    if template is not None:
        Vocabulary(source).write(path, template_text(template))
    _prompt_is_the_whole_strings(path, tmp_path, capsys)


def _prompt_is_the_whole_strings(
    path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`arbiter prompt` on ``path`` prints a prompt whose tokens are the whole string's."""
    lines = tmp_path / "one.jsonl"
    lines.write_text(json.dumps(decision_body("d1", state={"ticket": "TCK-4410"})) + "\n")
    assert main(["prompt", str(lines), "--json", "--model", str(path)]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    llama = _load(path)
    try:
        assert llama.vocab.space_prefix and llama.chat_template
        whole = llama.vocab.tokenize(record["text"], special=True)
        if llama.vocab.add_bos and whole[0] != llama.vocab.bos:
            whole = np.concatenate([[llama.vocab.bos], whole])
        view = open_prompts(llama, EngineSettings(model=path), load_profile(None))
        request = decision("d1", state={"ticket": "TCK-4410"})
        assert view.text(request) == record["text"]
        assert view.tokens(view.render(request)).tolist() == whole.tolist()
        assert record["tokens"] == len(whole)
    finally:
        llama.close()


def test_gemmas_vocabulary_with_a_forced_space_prefix_reads_its_letters_and_prompts(
    default_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 44: Gemma's SentencePiece vocabulary (the bundled Gemma 3's, under Gemma 2's chat
    template) with ``add_space_prefix`` set. ``"\\n"`` is a user-defined token there, after which llama.cpp
    writes the prefix again, so a letter read as it continues text after ``"\\n"`` came out
    ``"▁A"``, and the letters were refused at load."""
    vocabulary = Vocabulary(default_gguf)
    vocabulary.set_bool("tokenizer.ggml.add_space_prefix", True)
    path = vocabulary.write(
        tmp_path / "gemma-space-prefix.gguf", template_text("google-gemma-2-2b-it")
    )
    llama = _load(path)
    try:
        vocab = llama.vocab
        assert vocab.space_prefix
        (newline,) = vocab.tokenize("\n", special=False).tolist()[-1:]
        assert vocab.opens_text(newline)  # user-defined: "\nA" is "\n", "▁A" in llama.cpp
        assert vocab.tokenize("\nA", special=False)[-1] == vocab.tokenize("A", special=False)[-1]
        labels = Labels.of(llama)
        for row, letter in zip(labels.token_ids, LETTERS, strict=True):
            assert [vocab.piece_bytes(int(t)).decode() for t in row] == [letter, f" {letter}"]
    finally:
        llama.close()
    _prompt_is_the_whole_strings(path, tmp_path, capsys)


@pytest.fixture(scope="module")
def spm_engine(
    vocabularies: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    path = random_weights(
        vocabularies["llama-spm"],
        tmp_path_factory.mktemp("spm") / "llama-spm-random.gguf",
        template_text("llama-2-chat"),
    )
    settings = EngineSettings(model=path, n_threads=TEST_THREADS, n_ctx=4096, read_check="off")
    eng = open_engine(settings)
    yield eng
    eng.close()


def test_a_sentencepiece_model_scores_letters_and_codes_on_its_own_tokens(
    spm_engine: Engine,
) -> None:
    """The engine's path on a random-weight Llama with the Llama 2 SentencePiece vocabulary: the
    letters and the codes load, every prompt is the whole string's tokens, and the readout
    gives finite probabilities that sum to one."""
    eng = spm_engine
    assert eng.llama.vocab.space_prefix and eng.labels.token_ids.shape[1] == 2
    few = decision("few")
    many = decision("many", options=[(f"o{i}", f"Option {i}") for i in range(30)])
    for request in (few, many):
        whole = eng.llama.vocab.tokenize(eng.render_text(request), special=True)
        assert eng.prompt_tokens(request).tolist() == whole.tolist()  # the template writes <s>
    for outcome, n in zip(eng.score([few, many]), (len(few.options), 30), strict=True):
        assert isinstance(outcome, DecisionResult), outcome
        probabilities = outcome.probabilities
        assert len(probabilities) == n and abs(sum(probabilities) - 1) < 1e-6
        assert 0 < outcome.allowed_mass <= 1


def test_chat_segments_tokenize_as_the_whole_string_on_a_sentencepiece_model(
    spm_engine: Engine,
) -> None:
    from arbiter.prompt import render_chat

    messages = [
        ("system", "Be brief."),
        ("user", "Which queue? Billing or access."),
        ("assistant", "Billing"),
        ("user", "Why?"),
    ]
    segments = render_chat(messages, spm_engine.chat_template, "<s>", "</s>")
    whole = spm_engine.llama.vocab.tokenize("".join(text for text, _ in segments), special=True)
    assert spm_engine.encode_segments(segments).tolist() == whole.tolist()
