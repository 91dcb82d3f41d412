"""A character-level tokenizer built locally with the `tokenizers` library (nothing is downloaded).

Every printable ASCII character plus newline and tab is one token, so any task text (arithmetic, math,
Python code) round-trips exactly; the specials' spellings in text are plain characters. It is saved as
an ordinary Hugging Face ``tokenizer.json`` and loads with ``AutoTokenizer.from_pretrained`` like a real
model's tokenizer.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)
CHARACTERS = "".join(sorted(set(string.printable) - set("\r\x0b\x0c")))


def build_char_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per character and pad/eos/unk specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    # split_special_tokens: the text "<eos>" inside a task is five characters, never an injected EOS.
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
    )


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer saved in a model directory (ours or any Hugging Face one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
