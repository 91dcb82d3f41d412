"""Per-token log-probs and entropies of a causal LM without its [B, T, V] logits.

At Qwen3's 151,936-token vocabulary the float32 logits of one training micro-batch of 256 × 1,088
tokens take 169 GB, while the loss needs two numbers per position (``grpo.TokenStats``). So the model is
run without projecting any position onto the vocabulary (``final_hidden_states``: [B, T, hidden]), and
the output head, log_softmax and the reductions run on ``chunk_rows`` positions at a time. With gradients
each chunk is a non-reentrant ``torch.utils.checkpoint``: its [rows, V] intermediates are freed after
the forward and recomputed in the backward, so the memory beyond the hidden states is one chunk's
logits (a few [rows, V] tensors) whatever the vocabulary, for one more head matmul per chunk.

Only the positions the caller asks for (the completion tokens) are projected at all; the others get 0,
which ``grpo_loss`` ignores. Per position this is the computation of the full-logits path (the same
head on the same hidden state, then ``grpo.token_stats_from_logits``), batched differently.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from prime_node.ml.grpo import TokenStats

LOGIT_CHUNK_BYTES = 256 << 20
"""Float32 logits of one chunk at most (rows × vocab × 4 B): 441 positions at a 151,936 vocabulary."""


def chunk_rows(vocab_size: int, *, bytes_per_value: int = 4, budget_bytes: int | None = None) -> int:
    """Positions per chunk so that one [rows, vocab] matrix of ``bytes_per_value`` fits ``budget_bytes``
    (default ``LOGIT_CHUNK_BYTES``, read at call time); at least 1."""
    budget = LOGIT_CHUNK_BYTES if budget_bytes is None else budget_bytes
    return max(1, budget // (bytes_per_value * max(1, vocab_size)))


def final_hidden_states(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, hidden]: the decoder's output (after its final norm: the output head's input), from a call
    of the whole ``model`` that projects no position onto the vocabulary (``logits_to_keep`` = none).

    Why the whole model and not its decoder alone: under FSDP2 the root unit's forward hooks unshard the
    embeddings, final norm and head (and the root keeps them unsharded until its backward), so the head
    can then be applied chunk by chunk; called alone, the decoder would see sharded embeddings."""
    captured: list[torch.Tensor] = []

    def keep(_module: Any, _inputs: Any, output: Any) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    nothing = torch.empty(0, dtype=torch.long, device=input_ids.device)
    handle = model.get_decoder().register_forward_hook(keep)
    try:
        model(input_ids=input_ids, use_cache=False, logits_to_keep=nothing)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected one decoder forward, saw {len(captured)}")
    return captured[0]


def _chunk(
    head: Any, hidden: torch.Tensor, targets: torch.Tensor, scale: float, entropy: bool
) -> tuple[torch.Tensor, ...]:
    logits = head(hidden).float() / scale
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return (logp,)
    return logp, -(log_probs.exp() * log_probs).sum(-1)


def head_token_stats(
    hidden: torch.Tensor,
    head: Any,
    targets: torch.Tensor,
    *,
    temperature: float,
    entropy: bool = False,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(head(hidden) / T)[target] and the entropies (or None) for N rows of ``hidden``
    [N, hidden] and ``targets`` [N], ``rows`` (default ``chunk_rows`` of the head's vocabulary) at a time.

    Zero rows still run one empty chunk: the head and the decoder stay in the autograd graph, so an
    FSDP2 rank with no completion tokens reduces the same gradients as the others (zeros)."""
    scale = temperature if temperature > 0 else 1.0
    step = rows if rows is not None else chunk_rows(int(head.weight.shape[0]))
    grad = torch.is_grad_enabled()
    logps: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for start in range(0, max(1, hidden.shape[0]), step):
        part = (head, hidden[start : start + step], targets[start : start + step], scale, entropy)
        if grad:  # the chunk's [rows, V] intermediates are recomputed in the backward, not kept
            out = checkpoint(_chunk, *part, use_reentrant=False, preserve_rng_state=False)
        else:
            out = _chunk(*part)
        logps.append(out[0])
        if entropy:
            entropies.append(out[1])
    return torch.cat(logps), torch.cat(entropies) if entropy else None


def policy_token_stats(
    model: Any,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float,
    entropy: bool = False,
    rows: int | None = None,
) -> TokenStats:
    """``TokenStats`` [B, T] of ``model`` on ``input_ids`` [B, T] predicting ``targets`` [B, T], at the
    positions of ``mask`` (default: all; the others are 0), without materialising [B, T, V]."""
    hidden = final_hidden_states(model, input_ids)
    keep = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    logp, ent = head_token_stats(
        hidden[keep],
        model.get_output_embeddings(),
        targets[keep],
        temperature=temperature,
        entropy=entropy,
        rows=rows,
    )

    def spread(values: torch.Tensor) -> torch.Tensor:
        zeros = torch.zeros(targets.shape, dtype=values.dtype, device=values.device)
        return zeros.masked_scatter(keep, values)

    return TokenStats(spread(logp), None if ent is None else spread(ent))
