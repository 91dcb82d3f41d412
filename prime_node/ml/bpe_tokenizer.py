"""A Qwen-style byte-level BPE tokenizer trained here, on text the package ships (nothing is downloaded).

Byte-level means every string (any Unicode, any whitespace) round-trips exactly, like Qwen's and Llama 3's
tokenizers. The pre-tokenizer is Qwen2's regex, which splits numbers into single digits: arithmetic over
digits stays learnable by small models. The specials and the ChatML chat template are Qwen's
(``<|endoftext|>`` pads, ``<|im_end|>`` ends a turn and is the EOS a chat completion stops at), so code
written against a hub Qwen checkpoint works on ours unchanged.

Training is deterministic: the corpus files are read in sorted order and the ``tokenizers`` BPE trainer
breaks ties by a fixed order, so one vocabulary size gives one vocabulary.

A vocabulary larger than the corpus supports (the packaged corpus yields 5,679 tokens: merges of pairs
seen at least twice) is filled up with reserved ids, ``<|reserved_N|>`` for id N: BPE vocabulary entries
that no merge produces, so no text ever encodes to them, and that decode to nothing. So a tokenizer always
has exactly the ids its model's embedding has (Qwen3's 151,936 rows included): validators and the trainer
refuse any completion token at or past ``len(tokenizer)``, and a freshly initialised model samples every
row of its head.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prime_node.errors import NodeError

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2/Qwen3's pre-tokenizer regex: words with one leading non-letter, single digits, punctuation runs,
newline runs, other whitespace."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML as Qwen2.5 writes it, without tools and without a default system message: a turn is
``<|im_start|>{role}\\n{content}<|im_end|>\\n``; the generation prompt opens an assistant turn."""

MIN_VOCAB = len(SPECIAL_TOKENS) + 256
MAX_VOCAB = 151_936
"""Qwen3's vocabulary: the embedding rows of every Qwen3 checkpoint, and the largest we make."""
RESERVED = "<|reserved_{}|>"
RESERVED_PATTERN = r"^<\|reserved_[0-9]+\|>$"
"""A whole token that is a reserved id (the decoder drops it)."""


def corpus_dir() -> Path:
    """The packaged training text (see its README.md for how each file was made)."""
    return Path(__file__).resolve().parent.parent / "assets" / "tokenizer_corpus"


def corpus_files(directory: Path | None = None) -> list[Path]:
    """The ``*.txt`` files of the corpus, in a fixed (sorted) order."""
    root = directory or corpus_dir()
    files = sorted(root.glob("*.txt"))
    if not files:
        raise NodeError(f"no tokenizer corpus (*.txt) in {root} (a broken install?)", reason="bad_model_dir")
    return files


def _lines(files: list[Path]) -> Iterator[str]:
    for path in files:
        with path.open(encoding="utf-8") as handle:
            yield from handle


def train_bpe_tokenizer(vocab_size: int, corpus: list[Path] | None = None) -> Any:
    """A ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` ids: a byte-level BPE (specials included)
    trained on ``corpus`` (default: the packaged corpus) up to that size, reserved ids for the rest (see
    the module doc), Qwen's specials and the ChatML template."""
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise NodeError(
            f"vocab_size {vocab_size}: choose {MIN_VOCAB} (256 bytes + specials) to {MAX_VOCAB} (Qwen3's)",
            reason="bad_flag",
        )
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_lines(corpus or corpus_files()), trainer=trainer)
    return wrap_tokenizer(reserve_ids(core, vocab_size))


def reserve_ids(core: Any, vocab_size: int) -> Any:
    """``core`` (a trained ``tokenizers.Tokenizer``) with reserved ids appended up to ``vocab_size``: BPE
    vocabulary entries without a merge that makes them, and a decoder step that drops them."""
    learned = core.get_vocab_size(with_added_tokens=True)
    if learned >= vocab_size:
        return core
    from tokenizers import Tokenizer

    state = json.loads(core.to_str())
    vocab = state["model"]["vocab"]
    if len(vocab) != learned:  # the trainer keeps the specials in the model's vocabulary too
        raise NodeError(
            f"trained vocabulary has {len(vocab)} entries, the tokenizer {learned} ids",
            reason="bad_model_dir",
        )
    vocab.update({RESERVED.format(index): index for index in range(learned, vocab_size)})
    drop = {"type": "Replace", "pattern": {"Regex": RESERVED_PATTERN}, "content": ""}
    state["decoder"] = {"type": "Sequence", "decoders": [drop, state["decoder"]]}
    return Tokenizer.from_str(json.dumps(state))


def learned_size(tokenizer: Any) -> int:
    """Ids of ``tokenizer`` that text can encode to: all but the reserved ones."""
    reserved = RESERVED.format(0)[: RESERVED.index("{")]
    return sum(1 for token in tokenizer.get_vocab() if not token.startswith(reserved))


def wrap_tokenizer(core: Any) -> Any:
    """The transformers tokenizer around a trained ``tokenizers.Tokenizer``: pad ``<|endoftext|>``,
    eos ``<|im_end|>`` (as Qwen's instruct models), no BOS, the chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        pad_token=ENDOFTEXT,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
