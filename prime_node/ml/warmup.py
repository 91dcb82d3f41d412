"""Supervised warm-up: seconds of next-token training on (prompt, reference answer) pairs.

A randomly initialised model almost never earns a 0/1 reward, so GRPO has no signal (measured: no
progress in 5 minutes). A short supervised phase gives it a foothold, after which reinforcement learning
does the rest. The phase stops as soon as greedy accuracy on a probe of *training* tasks reaches
``target_accuracy`` (held-out tasks are never looked at), because the tiny model's loss drops in a sudden
transition whose step varies with the seed. Only tasks with a procedural reference answer support it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prime_node.ml.evaluation import greedy_accuracy
from prime_node.tasks.arithmetic import ArithmeticTask


@dataclass(frozen=True)
class WarmupResult:
    steps: int
    final_loss: float
    probe_accuracy: float


def supervised_warmup(
    model: Any,
    tokenizer: Any,
    task: ArithmeticTask,
    *,
    target_accuracy: float = 0.2,
    max_steps: int = 4000,
    check_every: int = 20,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    seed: int = 0,
) -> WarmupResult:
    """Train ``model`` in place until the training-probe greedy accuracy reaches ``target_accuracy``."""
    import torch

    from prime_node.ml.engines import setup_engine

    generator = torch.Generator().manual_seed(seed)
    pool: Sequence[int] = task.train_ids()
    probe = [pool[i] for i in torch.randperm(len(pool), generator=generator)[:128].tolist()]
    engine = setup_engine(model, tokenizer)
    max_answer = len(task.answer(len(pool) and max(pool))) + 2
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    loss_value, accuracy, step = float("nan"), 0.0, 0
    while step < max_steps:
        model.train()
        picks = torch.randint(len(pool), (batch_size,), generator=generator).tolist()
        rows, labels = [], []
        for index in picks:
            prompt = tokenizer.encode(task.prompt(pool[index]), add_special_tokens=False)
            answer = [*tokenizer.encode(task.answer(pool[index]), add_special_tokens=False), eos]
            rows.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
        mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
        loss = model(input_ids=ids, attention_mask=mask, labels=target).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
        step += 1
        if step % check_every == 0:
            model.eval()
            accuracy = greedy_accuracy(engine, tokenizer, task, probe, max_new_tokens=max_answer)
            if accuracy >= target_accuracy:
                break
    model.eval()
    return WarmupResult(steps=step, final_loss=loss_value, probe_accuracy=accuracy)
