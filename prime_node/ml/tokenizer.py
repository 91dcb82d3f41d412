"""A character-level tokenizer built locally with the `tokenizers` library (nothing is downloaded).

Every printable ASCII character plus newline and tab is one token, so any task text (arithmetic, math,
Python code) round-trips exactly; the specials' spellings in text are plain characters. It is saved as
an ordinary Hugging Face ``tokenizer.json`` and loads with ``AutoTokenizer.from_pretrained`` like a real
model's tokenizer.

``load_tokenizer`` reads a directory whose tokenizer_config.json names the generic backend
(``TokenizersBackend``/``PreTrainedTokenizerFast``, as ours do) exactly as its tokenizer.json says.
transformers' ``AutoTokenizer`` does not for some model types: for a ``qwen2`` config.json it builds
``Qwen2Tokenizer``, which replaces the saved pre-tokenizer with its byte-level one, and this character
vocabulary then loses every space and newline.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

from prime_node.errors import NodeError

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


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""tokenizer_config.json classes meaning "tokenizer.json is the whole tokenizer"."""


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer saved in a model directory (ours or any Hugging Face one)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if _declared_class(model_dir) in GENERIC_TOKENIZER_CLASSES and (model_dir / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return AutoTokenizer.from_pretrained(str(model_dir))


def _declared_class(model_dir: Path) -> str | None:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise NodeError(f"{path} is not readable JSON: {exc}", reason="bad_model_dir") from exc
    declared = config.get("tokenizer_class") if isinstance(config, dict) else None
    return declared if isinstance(declared, str) else None
