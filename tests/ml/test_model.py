from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prime_node.errors import NodeError
from prime_node.ml.model import create_tiny_model, load_model, parameter_count, save_model_dir
from prime_node.ml.tokenizer import CHARACTERS, build_char_tokenizer, load_tokenizer

_TOKENIZER = build_char_tokenizer()


@given(st.text(alphabet=CHARACTERS, max_size=80))
def test_tokenizer_round_trips_every_task_text(text: str) -> None:
    ids = _TOKENIZER.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert _TOKENIZER.decode(ids) == text


def test_saved_model_and_tokenizer_load_back_bit_exactly(tmp_path: Path) -> None:
    model, tokenizer = create_tiny_model(seed=3)
    save_model_dir(model, tokenizer, tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "tokenizer.json").is_file()
    assert not list(tmp_path.glob("*.bin")) and not list(tmp_path.glob("*.pt"))
    loaded = load_model(tmp_path)
    ids = torch.randint(0, len(tokenizer), (3, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    reloaded = load_tokenizer(tmp_path)
    assert reloaded.encode("12+34=", add_special_tokens=False) == tokenizer.encode(
        "12+34=", add_special_tokens=False
    )
    assert reloaded.eos_token_id == tokenizer.eos_token_id
    assert 100_000 < parameter_count(loaded) < 200_000


def test_same_seed_same_weights_different_seed_different_weights() -> None:
    a, _ = create_tiny_model(seed=1)
    b, _ = create_tiny_model(seed=1)
    c, _ = create_tiny_model(seed=2)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


def test_loading_refuses_directories_without_safetensors(tmp_path: Path) -> None:
    with pytest.raises(NodeError, match="does not exist"):
        load_model(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle would run code")
    with pytest.raises(NodeError, match="safetensors"):
        load_model(tmp_path)
