"""The byte-level BPE tokenizer trained on the packaged corpus, and tokenizers surviving save + reload."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prime_node.errors import NodeError
from prime_node.ml.bpe_tokenizer import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    corpus_files,
    train_bpe_tokenizer,
)
from prime_node.ml.model import create_tiny_model, save_model_dir
from prime_node.ml.tokenizer import load_tokenizer

VOCAB = 1024


@pytest.fixture(scope="module")
def saved_bpe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(tokenizer as trained, the same tokenizer reloaded by AutoTokenizer from a saved directory)."""
    from transformers import AutoTokenizer

    tokenizer = train_bpe_tokenizer(VOCAB)
    out = tmp_path_factory.mktemp("bpe")
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    return tokenizer, AutoTokenizer.from_pretrained(str(out))


def test_training_is_deterministic_and_fills_the_vocabulary() -> None:
    a, b = train_bpe_tokenizer(VOCAB), train_bpe_tokenizer(VOCAB)
    assert len(a) == VOCAB
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()  # vocab and merges in order
    assert len(train_bpe_tokenizer(4096)) == 4096


def test_specials_are_qwens(saved_bpe: tuple[Any, Any]) -> None:
    _, tokenizer = saved_bpe
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.bos_token) == (ENDOFTEXT, IM_END, None)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == [ENDOFTEXT, IM_START, IM_END]
    assert tokenizer.encode("a", add_special_tokens=False) == tokenizer.encode("a")  # nothing prepended
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_digits_are_single_tokens_and_common_words_are_merged(saved_bpe: tuple[Any, Any]) -> None:
    tokenizer, _ = saved_bpe
    assert len(tokenizer.encode("1234567", add_special_tokens=False)) == 7
    assert len(tokenizer.encode(" return", add_special_tokens=False)) == 1


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_any_text_round_trips_after_save_and_auto_reload(saved_bpe: tuple[Any, Any], text: str) -> None:
    """Byte-level: any string comes back, up to the NFC normalisation Qwen's tokenizer also applies."""
    trained, reloaded = saved_bpe
    ids = reloaded.encode(text, add_special_tokens=False)
    assert ids == trained.encode(text, add_special_tokens=False)
    assert reloaded.decode(ids) == unicodedata.normalize("NFC", text)


@pytest.mark.parametrize(
    "text",
    ["two  spaces,\ttab\nnewline\n\n  indent", "Zürich — 中文 👍 ∑x²", "def f(x):\n    return x + 1\n"],
)
def test_whitespace_and_unicode_round_trip(saved_bpe: tuple[Any, Any], text: str) -> None:
    _, tokenizer = saved_bpe
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_renders_chatml_with_a_generation_prompt(saved_bpe: tuple[Any, Any]) -> None:
    _, tokenizer = saved_bpe
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_START)) == 3
    assert ids.count(tokenizer.eos_token_id) == 2


def test_the_corpus_is_packaged_text_of_bounded_size() -> None:
    files = corpus_files()
    assert {f.name for f in files} >= {"code.txt", "docs.txt", "tasks.txt", "handwritten.txt"}
    assert sum(f.stat().st_size for f in files) < 300_000


def test_a_missing_corpus_or_tiny_vocabulary_is_a_node_error(tmp_path: Path) -> None:
    with pytest.raises(NodeError, match="no tokenizer corpus"):
        corpus_files(tmp_path)
    with pytest.raises(NodeError, match="vocab_size"):
        train_bpe_tokenizer(100)


def test_char_tokenizer_keeps_whitespace_after_save_and_reload(tmp_path: Path) -> None:
    """Regression: for a qwen2 config.json AutoTokenizer builds Qwen2Tokenizer, whose byte-level
    pre-tokenizer replaced ours and dropped every space and newline of the character vocabulary."""
    model, tokenizer = create_tiny_model(seed=0)
    save_model_dir(model, tokenizer, tmp_path)
    reloaded = load_tokenizer(tmp_path)
    text = "def f(x):\n    return x  # two spaces"
    ids = reloaded.encode(text, add_special_tokens=False)
    assert ids == tokenizer.encode(text, add_special_tokens=False)  # the same token ids as before saving
    assert reloaded.decode(ids) == text
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] in (
        "TokenizersBackend",
        "PreTrainedTokenizerFast",
    )


def test_an_unreadable_tokenizer_config_is_a_node_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(NodeError) as caught:
        load_tokenizer(tmp_path)
    assert caught.value.reason == "bad_model_dir"
