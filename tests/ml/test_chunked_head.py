"""The chunked output head (prime_node/ml/chunked_head.py) gives the full-logits loss: the same values and
gradients, for every objective with the KL and entropy terms on, plain and FSDP2-sharded, and the
validator's chunked replay gives the whole-matrix margins and log-probs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import prime_node.ml.trainer as trainer_module
from prime_node.config import RunConfig
from prime_node.ml import chunked_head, sampling
from prime_node.ml.chunked_head import final_hidden_states, policy_token_stats
from prime_node.ml.distributed import DistInfo
from prime_node.ml.engine import SamplingParams, prefill_logprobs, prefill_replay
from prime_node.ml.engines import setup_engine
from prime_node.ml.grpo import OBJECTIVES, Objective, grpo_loss, token_stats_from_logits
from prime_node.ml.model import create_tiny_model
from prime_node.ml.prepared import Prepared
from prime_node.ml.trainer import GRPOTrainer, _micro_batch

TEMPERATURE = 0.7


def _batch(vocab: int, seed: int = 3) -> tuple[list[list[int]], list[int]]:
    """Ragged sequences: prompts of 3 to 6 tokens, completions of 1 to 9 (right padding, masked)."""
    generator = torch.Generator().manual_seed(seed)
    sequences, prompt_lengths = [], []
    for _ in range(5):
        prompt = int(torch.randint(3, 7, (1,), generator=generator))
        total = prompt + int(torch.randint(1, 10, (1,), generator=generator))
        sequences.append(torch.randint(3, vocab, (total,), generator=generator).tolist())
        prompt_lengths.append(prompt)
    return sequences, prompt_lengths


def _loss(
    model: Any, objective: Objective, *, chunked: bool, rows: int
) -> tuple[Any, dict[str, torch.Tensor]]:
    """One micro-batch's GRPO loss (KL and entropy terms on) and the gradient it gives every parameter."""
    sequences, prompt_lengths = _batch(model.config.vocab_size)
    ids, targets, mask = _micro_batch(sequences, prompt_lengths, pad=0)
    generator = torch.Generator().manual_seed(5)
    noise = 0.3 * torch.randn(targets.shape, generator=generator)
    with torch.no_grad():
        own = token_stats_from_logits(
            model(input_ids=ids).logits, targets, temperature=TEMPERATURE, entropy=False
        ).logp
    model.zero_grad(set_to_none=True)
    if chunked:
        stats = policy_token_stats(
            model, ids, targets, mask, temperature=TEMPERATURE, entropy=True, rows=rows
        )
    else:
        stats = model(input_ids=ids, use_cache=False).logits
    parts = grpo_loss(
        stats,
        targets,
        own + noise if objective == "recompute" else None,
        torch.tensor([1.0, -0.5, 0.25, -1.0, 0.8]),
        mask,
        normalizer=float(mask.sum()),
        temperature=TEMPERATURE,
        eps_low=0.2,
        eps_high=0.28,
        delta=4.0,
        ref_logp=own - noise,
        kl_coef=0.05,
        entropy_coef=0.01,
        objective=objective,
        behaviour_logp=own + 0.5 * noise,
        is_kl_coef=0.1,
    )
    parts.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return parts, grads


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_chunked_loss_equals_the_full_logits_loss(objective: Objective) -> None:
    """Chunks of 4 positions (the last one ragged) over 5 ragged sequences: every reported part and every
    parameter's gradient as with the [B, T, V] logits, up to float reassociation."""
    model, _ = create_tiny_model(seed=1)
    model.train()
    full, full_grads = _loss(model, objective, chunked=False, rows=4)
    chunked, chunked_grads = _loss(model, objective, chunked=True, rows=4)
    assert full.policy != 0 and full.entropy > 0 and full.kl > 0
    assert torch.allclose(chunked.loss, full.loss, rtol=1e-5, atol=1e-7)
    for name in ("policy", "kl", "entropy", "clipped_fraction", "is_fraction"):
        assert getattr(chunked, name) == pytest.approx(getattr(full, name), rel=1e-5, abs=1e-7), name
    assert full_grads.keys() == chunked_grads.keys() and full_grads
    for name, grad in full_grads.items():
        assert torch.allclose(chunked_grads[name], grad, rtol=1e-4, atol=1e-7), name


def test_the_hidden_states_are_the_heads_input_and_no_position_is_projected() -> None:
    model, _ = create_tiny_model(seed=1)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        hidden = final_hidden_states(model, ids)
        logits = model(input_ids=ids).logits
    assert hidden.shape == (2, 4, model.config.hidden_size)
    assert torch.allclose(model.get_output_embeddings()(hidden), logits, atol=1e-6)


def test_a_rank_without_completion_tokens_still_reaches_every_parameter() -> None:
    """An FSDP2 rank that ran out of samples trains a fully masked pad sample: its zero gradient must
    still reach the head, the decoder and the embeddings, or its reduce-scatters differ from the others'."""
    model, _ = create_tiny_model(seed=1)
    ids, targets, mask = _micro_batch([[0, 0]], [2], pad=0)
    stats = policy_token_stats(model, ids, targets, mask, temperature=1.0)
    stats.logp.sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and not g.any() for g in grads)


def _full_logits_stats(model: Any, ids: Any, targets: Any, mask: Any = None, **kwargs: Any) -> Any:
    """The previous trainer path: the [B, T, V] logits of the whole model, then log_softmax."""
    logits = model(input_ids=ids, use_cache=False).logits
    return token_stats_from_logits(
        logits, targets, temperature=kwargs["temperature"], entropy=kwargs.get("entropy", False)
    )


def _trainer_step(model: Any, tokenizer: Any, tmp_path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """One FSDP2 step (world size 1) with the recompute objective on a stale batch (old log-probs through
    ``_token_logp`` of the old model), a KL reference and an entropy bonus; and the full gradient."""
    config = RunConfig(
        group_size=2,
        prompts_per_step=2,
        max_new_tokens=9,
        temperature=TEMPERATURE,
        objective="recompute",
        kl_coef=0.05,
        entropy_coef=0.01,
        micro_batch_samples=3,
        grad_clip=1e9,
    )
    trainer = GRPOTrainer(config, model, tokenizer, checkpoint_root=tmp_path, dist=DistInfo())
    trainer.step = 1  # the batch is policy 0's, which the history holds: old log-probs are recomputed
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():  # the policy moves away from policy 0 and the KL reference: no term is 0
        for param in trainer.model.parameters():
            local = param.to_local()
            local.add_(0.05 * torch.randn(local.shape, generator=generator))
    sequences, prompt_lengths = _batch(model.config.vocab_size)
    prepared = Prepared(0, sequences[:4], prompt_lengths[:4], [1.0, -1.0, 0.5, -0.5], 0.0, 2, 0)
    metrics = trainer.train_step(prepared)
    grads = {name: p.grad.full_tensor().clone() for name, p in trainer.model.named_parameters()}
    return metrics, grads


def test_a_sharded_trainer_step_equals_the_full_logits_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = create_tiny_model(seed=2)
    monkeypatch.setattr(chunked_head, "LOGIT_CHUNK_BYTES", 4 * 4 * model.config.vocab_size)  # 4 rows
    reference = copy.deepcopy(model)
    chunked, chunked_grads = _trainer_step(model, tokenizer, tmp_path / "chunked")
    monkeypatch.setattr(trainer_module, "policy_token_stats", _full_logits_stats)
    full, full_grads = _trainer_step(reference, tokenizer, tmp_path / "full")
    assert full.grad_norm > 0 and full.kl > 0 and full.entropy > 0 and full.clipped_fraction > 0
    for name in ("loss", "kl", "entropy", "clipped_fraction", "grad_norm"):
        assert getattr(chunked, name) == pytest.approx(getattr(full, name), rel=1e-5, abs=1e-7), name
    assert full_grads.keys() == chunked_grads.keys()
    for name, grad in full_grads.items():
        assert torch.allclose(chunked_grads[name], grad, rtol=1e-4, atol=1e-7), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_chunked_replay_gives_the_whole_matrix_values(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 3 positions across three completions: the margins and log-probs a validator computed
    from the [tokens, vocab] logits, up to a float32 rounding of the head's matmul."""
    from prime_node.ml.sampling import replay_margin, token_logprobs

    model, tokenizer = create_tiny_model(seed=0)
    engine = setup_engine(model, tokenizer, dtype=dtype)
    prompts, seeds = [[22, 23, 16], [30, 31], [40, 41, 42, 43]], [5, 6, 7]
    completions = [c.tokens for c in engine.generate(prompts, seeds, SamplingParams(16, temperature=0.8))]
    prefills = engine.prefill(prompts, completions)
    logits = torch.cat([p.logits for p in prefills])
    tokens = [t for c in completions for t in c]
    flat_seeds = [s for s, c in zip(seeds, completions, strict=True) for _ in c]
    positions = [i for c in completions for i in range(len(c))]
    whole_margins = replay_margin(logits, flat_seeds, positions, 0.8, tokens)
    whole_logps = token_logprobs(logits, torch.tensor(tokens), 0.8)
    monkeypatch.setattr(sampling, "REPLAY_CHUNK_BYTES", 3 * 8 * logits.shape[1])
    assert len(tokens) > 9
    logps, margins = prefill_replay(prefills, completions, 0.8, seeds)
    assert margins.dtype == torch.float64 and logps.dtype == torch.float32
    assert torch.allclose(margins, whole_margins, rtol=0, atol=1e-5)
    assert torch.allclose(logps, whole_logps, rtol=0, atol=1e-5)
    assert torch.equal(prefill_logprobs(prefills, completions, 0.8), logps)
    assert float(margins.max()) < 1e-4  # the engine replays its own tokens
