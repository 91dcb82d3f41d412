"""``init-model --arch qwen3 --size 0.6b``, ``--vocab`` and ``--dtype``: the real Qwen3-0.6B shape (checked
on the meta device, no memory), exact parameter counts without building, tokenizers with exactly the
model's ids, and a directory the project's loader reads (a tiny one by default, the 0.6b one when slow
tests run)."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from prime_node.errors import NodeError
from prime_node.ml.architectures import SHAPES, SIZES, create_model, model_shape
from prime_node.ml.bpe_tokenizer import MAX_VOCAB, MIN_VOCAB, RESERVED, learned_size, train_bpe_tokenizer
from prime_node.ml.model import load_model, parameter_count
from prime_node.ml.tokenizer import load_tokenizer
from prime_node.ml.vram_plan import model_shape as checkpoint_shape
from tests import warm_cli
from tests.cli_in_process import run_cli

REPO = Path(__file__).resolve().parents[2]
CORPUS_LIMIT = 5679
"""BPE tokens the packaged corpus supports (merges of pairs seen at least twice)."""
QWEN3_06B_CONFIG = {  # Qwen/Qwen3-0.6B config.json, the fields that make its shape
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
}


def _header_dtypes(path: Path) -> set[str]:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}


def test_the_06b_size_is_qwen3_06b_on_the_meta_device() -> None:
    model, tokenizer = create_model("qwen3", "0.6b", 0, dtype="auto", device="meta")
    config = model.config.to_dict()
    assert {key: config[key] for key in QWEN3_06B_CONFIG} == QWEN3_06B_CONFIG
    assert config["rope_parameters"]["rope_theta"] == 1_000_000.0 and model.config.model_type == "qwen3"
    assert len(tokenizer) == MAX_VOCAB and learned_size(tokenizer) == CORPUS_LIMIT
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # how Qwen3 ships
    assert parameter_count(model) == model_shape("qwen3", "0.6b").parameters() == 596_049_920


@pytest.mark.parametrize("size", SIZES)
def test_the_parameter_formula_counts_what_transformers_builds(size: str) -> None:
    shape = model_shape("qwen3", size)
    for vocab in (MIN_VOCAB, 4096):
        model, tokenizer = create_model("qwen3", size, 0, vocab_size=vocab, device="meta")
        assert len(tokenizer) == model.config.vocab_size == vocab
        assert parameter_count(model) == shape.parameters(vocab)
    assert model_shape("qwen3", "0.6b").parameters(4096) == 444_661_760


def test_a_vocabulary_past_the_corpus_is_filled_with_reserved_ids_no_text_reaches(tmp_path: Path) -> None:
    tokenizer = train_bpe_tokenizer(CORPUS_LIMIT + 300)
    assert len(tokenizer) == CORPUS_LIMIT + 300 and learned_size(tokenizer) == CORPUS_LIMIT
    assert len(train_bpe_tokenizer(1024)) == learned_size(train_bpe_tokenizer(1024)) == 1024
    tokenizer.save_pretrained(str(tmp_path), save_jinja_files=False)
    reloaded = load_tokenizer(tmp_path)
    last = CORPUS_LIMIT + 299
    text = f"12+34=46 {RESERVED.format(last)} héllo\n<|im_end|>"
    for each in (tokenizer, reloaded):
        assert each.convert_ids_to_tokens(last) == RESERVED.format(last)
        ids = each.encode(text, add_special_tokens=False)
        assert max(ids) < CORPUS_LIMIT and each.decode(ids) == text  # the literal text round-trips
        assert each.decode([ids[0], CORPUS_LIMIT, last, ids[1]]) == each.decode([ids[0], ids[1]])
    for bad in (MIN_VOCAB - 1, MAX_VOCAB + 1):
        with pytest.raises(NodeError) as caught:
            train_bpe_tokenizer(bad)
        assert caught.value.reason == "bad_flag" and str(MAX_VOCAB) in str(caught.value)


def test_init_model_vocab_and_dtype_write_what_the_loader_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny-bf16"
    vocab = CORPUS_LIMIT + 21
    args = ("init-model", "--arch", "qwen3", "--size", "tiny", "--vocab", str(vocab), "--dtype", "bf16")
    done = run_cli(capsys, *args, str(out), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    shape = model_shape("qwen3", "tiny")
    assert summary["vocab_size"] == vocab and summary["learned_tokens"] == CORPUS_LIMIT
    assert summary["dtype"] == "bfloat16" and summary["parameters"] == shape.parameters(vocab)
    assert _header_dtypes(out / "model.safetensors") == {"BF16"}
    assert summary["bytes_written"] >= 2 * summary["parameters"]
    assert checkpoint_shape(out).params == summary["parameters"]  # sizing reads the headers, any dtype
    model, tokenizer = load_model(out), load_tokenizer(out)
    assert model.config.vocab_size == len(tokenizer) == vocab
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the loader's dtype, not the file's
    reference, _ = create_model("qwen3", "tiny", 0, vocab_size=vocab)
    rounded = reference.model.embed_tokens.weight.bfloat16().float()  # the float32 model, rounded
    assert torch.equal(model.model.embed_tokens.weight, rounded)
    auto = tmp_path / "tiny-auto"  # --dtype auto: the size's (float32 for tiny)
    done = run_cli(capsys, "init-model", "--arch", "qwen3", "--size", "tiny", str(auto), "--json")
    assert json.loads(done.stdout)["dtype"] == "float32"
    assert _header_dtypes(auto / "model.safetensors") == {"F32"}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--arch", "qwen3", "--size", "0.6b", "--vocab", "100"), f"choose {MIN_VOCAB}"),
        (("--arch", "qwen3", "--size", "0.6b", "--vocab", "151937"), "151936 (Qwen3's vocabulary)"),
        (("--arch", "qwen3", "--size", "0.6b", "--dtype", "fp16"), "use auto, bf16 or fp32"),
        (("--arch", "qwen3", "--size", "7b"), "qwen3/0.6b"),
        (("--tiny", "--vocab", "4096"), "--vocab and --dtype size an --arch model"),
    ],
)
def test_bad_sizes_are_one_line_errors_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], says: str
) -> None:
    done = run_cli(capsys, "init-model", *args, str(tmp_path / "out"))
    assert done.returncode == 1 and says in done.stderr and done.stderr.strip().count("\n") == 0
    assert not (tmp_path / "out").exists()


def test_a_disk_too_small_is_refused_before_initialising(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def nearly_full(path: Any) -> Any:
        return SimpleNamespace(total=1 << 40, used=(1 << 40) - (100 << 20), free=100 << 20)

    monkeypatch.setattr("shutil.disk_usage", nearly_full)
    done = run_cli(capsys, "init-model", "--arch", "qwen3", "--size", "0.6b", str(tmp_path / "out"))
    assert done.returncode == 1 and "1.26 GB needed, 0.10 GB free" in done.stderr
    assert "--dtype bf16 / a smaller --vocab" in done.stderr and not (tmp_path / "out").exists()


def test_help_lists_every_size(capsys: pytest.CaptureFixture[str]) -> None:
    done = run_cli(capsys, "init-model", "--help")
    text = " ".join(done.stdout.split())
    assert done.returncode == 0
    for _, size in SHAPES:
        assert f" {size} (" in text, size
    assert "--vocab" in text and "--dtype" in text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_init_model_06b_in_a_real_process_and_the_loader_runs_it(tmp_path: Path) -> None:
    """The whole 0.44B model (4,096 ids: the embedding is not what this is about) written in bf16 by the
    command and read back by ``load_model`` in its own dtype."""
    out = tmp_path / "qwen3-0.6b"
    command = ["init-model", "--arch", "qwen3", "--size", "0.6b", "--vocab", "4096", str(out), "--json"]
    done = warm_cli.run(
        [sys.executable, "-m", "prime_node", *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["parameters"] == 444_661_760 and summary["dtype"] == "bfloat16"
    assert 2 * summary["parameters"] <= summary["bytes_written"] < 2 * summary["parameters"] + (64 << 20)
    assert checkpoint_shape(out).params == summary["parameters"]
    model = load_model(out, dtype="bfloat16")
    assert parameter_count(model) == summary["parameters"] and model.config.num_hidden_layers == 28
    with torch.no_grad():
        logits = model(torch.tensor([[1, 40, 41, 42]])).logits
    assert logits.shape == (1, 4, 4096) and bool(torch.isfinite(logits).all())
