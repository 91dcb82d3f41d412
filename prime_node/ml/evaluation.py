"""Held-out greedy accuracy: the number the learning benchmark and the trainer's log report."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prime_node.errors import NodeError
from prime_node.ml.engine import SamplingParams, TorchEngine
from prime_node.tasks.base import TaskSource
from prime_node.tasks.chat import ChatPrompt


def completion_text(tokenizer: Any, tokens: Sequence[int], eos_token_id: int) -> str:
    """Decoded completion without its terminating EOS."""
    if tokens and tokens[-1] == eos_token_id:
        tokens = tokens[:-1]
    return str(tokenizer.decode(list(tokens), skip_special_tokens=False))


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Prompt token ids. Every role encodes through here, so trainer, inferer and validator agree: a
    ``ChatPrompt`` becomes a user turn in the tokenizer's chat template with the assistant turn opened
    (completions then end at its end-of-turn EOS); any other text is encoded as is."""
    if not isinstance(text, ChatPrompt):
        return list(tokenizer.encode(text, add_special_tokens=False))
    if not getattr(tokenizer, "chat_template", None):
        raise NodeError(
            "the task is posed through a chat template (task.chat = true) but the model's tokenizer has "
            "none: use a model with one (init-model --arch qwen3) or set task.chat = false",
            reason="bad_config",
        )
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": str(text)}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def greedy_accuracy(
    engine: TorchEngine,
    tokenizer: Any,
    task: TaskSource,
    task_ids: Sequence[int],
    *,
    max_new_tokens: int,
    batch_size: int = 256,
) -> float:
    """Mean checker score of greedy (temperature 0) completions over ``task_ids``."""
    if not task_ids:
        return 0.0
    total = 0.0
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    for start in range(0, len(task_ids), batch_size):
        chunk = task_ids[start : start + batch_size]
        prompts = [encode_prompt(tokenizer, task.prompt(i)) for i in chunk]
        for task_id, completion in zip(
            chunk, engine.generate(prompts, [0] * len(chunk), params), strict=True
        ):
            total += task.score(task_id, completion_text(tokenizer, completion.tokens, engine.eos_token_id))
    return total / len(task_ids)
