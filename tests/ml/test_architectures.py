"""Named Qwen3-shaped models: what they are made of, that the Auto classes load them like hub checkpoints,
the math task posed through their chat template, and other HF families through the same loading path."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from prime_node.config import TaskConfig
from prime_node.errors import NodeError
from prime_node.ml.architectures import SHAPES, create_model, model_shape, write_model_dir
from prime_node.ml.engine import SamplingParams
from prime_node.ml.engines import load_engine
from prime_node.ml.evaluation import completion_text, encode_prompt
from prime_node.ml.model import create_tiny_model, load_model, parameter_count, save_model_dir
from prime_node.ml.tokenizer import load_tokenizer
from prime_node.tasks.chat import ChatPrompt
from prime_node.tasks.factory import build_task
from prime_node.tasks.math import BOXED_INSTRUCTION, MathTask
from tests import warm_cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qwen3_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir("qwen3", "tiny", 0, tmp_path_factory.mktemp("qwen3-tiny"))


def test_tiny_is_a_qwen3_with_grouped_query_attention_qk_norm_and_a_tied_head() -> None:
    model, tokenizer = create_model("qwen3", "tiny", seed=0)
    config = model.config
    assert config.model_type == "qwen3" and config.vocab_size == len(tokenizer) == 1024
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    attention = model.model.layers[0].self_attn
    assert attention.k_proj.out_features == config.num_key_value_heads * config.head_dim
    assert attention.q_norm.weight.shape == (config.head_dim,)  # Qwen3's per-head RMSNorm on q and k
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert (config.eos_token_id, config.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert 200_000 < parameter_count(model) < 400_000


def test_small_has_ten_to_thirty_million_parameters_and_an_untied_head() -> None:
    model, tokenizer = create_model("qwen3", "small", seed=0)
    assert len(tokenizer) == 4096 and not model.config.tie_word_embeddings
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert 10_000_000 <= parameter_count(model) <= 30_000_000


def test_same_seed_same_weights_and_vocabulary_other_seed_other_weights() -> None:
    rng_before = torch.random.get_rng_state()
    (a, ta), (b, tb), (c, _) = (create_model("qwen3", "tiny", seed=s) for s in (5, 5, 6))
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the global RNG is left alone
    assert ta.backend_tokenizer.to_str() == tb.backend_tokenizer.to_str()
    for (name, wa), wb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(wa, wb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_unknown_names_are_node_errors() -> None:
    for arch, size in (("qwen3", "huge"), ("gpt2", "tiny")):
        with pytest.raises(NodeError) as caught:
            model_shape(arch, size)
        assert caught.value.reason == "bad_flag" and "qwen3/small" in str(caught.value)
    assert set(SHAPES) == {("qwen3", "tiny"), ("qwen3", "small"), ("qwen3", "0.6b")}


def test_auto_classes_load_it_and_chat_then_generate_work(qwen3_tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert "chat_template" in json.loads((qwen3_tiny_dir / "tokenizer_config.json").read_text())
    tokenizer: Any = AutoTokenizer.from_pretrained(str(qwen3_tiny_dir))
    model: Any = AutoModelForCausalLM.from_pretrained(str(qwen3_tiny_dir))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 6 times 7?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    prompt = inputs["input_ids"]
    assert tokenizer.decode(prompt[0]).endswith("<|im_start|>assistant\n")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 1 and prompt.shape[1] < out.shape[1] <= prompt.shape[1] + 4
    assert torch.equal(out[0, : prompt.shape[1]], prompt[0])
    original, _ = create_model("qwen3", "tiny", seed=0)  # the directory holds exactly the seeded weights
    with torch.no_grad():
        assert torch.equal(original(prompt).logits, model(prompt).logits)


def test_load_model_reads_it_in_both_dtypes(qwen3_tiny_dir: Path) -> None:
    ids = torch.tensor([[1, 40, 41, 42]])
    fp32, bf16 = load_model(qwen3_tiny_dir), load_model(qwen3_tiny_dir, dtype="bfloat16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        reference, low = fp32(ids).logits, bf16(ids).logits.float()
    # Measured over seeds 0-4, 4x32 random tokens: max |fp32 - bf16| logit 0.009 (AVX2 kernels), 0.011
    # (ATEN_CPU_CAPABILITY=default); logits themselves reach ~1.2.
    assert torch.allclose(reference, low, atol=0.05)


def test_math_posed_through_the_chat_template_scores_a_boxed_answer(
    qwen3_tiny_dir: Path, tmp_path: Path
) -> None:
    tasks = tmp_path / "math.jsonl"
    tasks.write_text(json.dumps({"question": "What is 6 times 7?", "answer": "42"}) + "\n")
    task = build_task(TaskConfig.model_validate({"kind": "math", "path": str(tasks), "chat": True}))
    prompt = task.prompt(0)
    assert isinstance(prompt, ChatPrompt) and prompt.endswith(BOXED_INSTRUCTION)
    tokenizer = load_tokenizer(qwen3_tiny_dir)
    ids = encode_prompt(tokenizer, prompt)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": str(prompt)}], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(ids) == expected and ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    completion = tokenizer.encode("6 times 7 is $\\boxed{42}$.", add_special_tokens=False)
    text = completion_text(tokenizer, [*completion, tokenizer.eos_token_id], tokenizer.eos_token_id)
    assert task.score(0, text) == 1.0 and task.score(0, "\\boxed{41}") == 0.0
    # Without chat the same question is raw text, as before.
    plain = MathTask.from_file(tasks)
    assert encode_prompt(tokenizer, plain.prompt(0)) == tokenizer.encode(
        "What is 6 times 7?", add_special_tokens=False
    )


def test_chat_needs_a_tokenizer_with_a_template_and_the_math_task() -> None:
    _, char_tokenizer = create_tiny_model(seed=0)
    with pytest.raises(NodeError) as caught:
        encode_prompt(char_tokenizer, ChatPrompt("2+2?"))
    assert caught.value.reason == "bad_config" and "chat template" in str(caught.value)
    with pytest.raises(ValueError, match="math task only"):
        TaskConfig.model_validate({"kind": "arithmetic", "chat": True})


def test_a_llama_directory_loads_through_load_model_and_the_engine_factory(tmp_path: Path) -> None:
    """Any HF causal-LM family loads through the same path: here a tiny Llama with our BPE tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = create_model("qwen3", "tiny", seed=0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    save_model_dir(LlamaForCausalLM(config), tokenizer, tmp_path)
    loaded = load_model(tmp_path)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    reloaded = load_tokenizer(tmp_path)
    engine = load_engine(tmp_path, reloaded)
    prompt = encode_prompt(reloaded, ChatPrompt("2+2?"))
    [completion] = engine.generate([prompt], [1], SamplingParams(max_new_tokens=3))
    assert 1 <= len(completion.tokens) <= 3 and len(completion.logprobs) == len(completion.tokens)


def test_init_model_arch_writes_a_directory_from_a_real_process(tmp_path: Path) -> None:
    out = tmp_path / "qwen3"
    done = warm_cli.run(
        [
            sys.executable,
            "-m",
            "prime_node",
            "init-model",
            "--arch",
            "qwen3",
            "--size",
            "tiny",
            str(out),
            "--seed",
            "3",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["arch"] == "qwen3" and summary["vocab_size"] == 1024 and summary["tied_head"] is True
    model = load_model(out)
    assert type(model).__name__ == "Qwen3ForCausalLM" and parameter_count(model) == summary["parameters"]
