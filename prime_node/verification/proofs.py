"""TOPLOC proofs from the engine's final hidden states, and their check against a validator's prefill.

The inferer passes ``Completion.hidden`` (float32 [n_tokens, hidden], row t = the final hidden state at
the position that predicted token t) and gets one proof blob per completion: 258 bytes per started
chunk of 32 tokens, the layout of ``crypto.toploc``. The validator passes ``Prefill.hidden`` for the
same tokens and gets one ``ChunkCheck`` per chunk. Rounding to bf16 (round to nearest even, as torch
does) happens in ``crypto.toploc`` and only for the entries that can reach the top-k, so both sides
commit to and compare the same bit patterns without converting whole hidden-state matrices; all the
arithmetic is the pure numpy code in ``crypto.toploc``. The acceptance bounds are calibrated per engine
family and dtype (``crypto.toploc.CALIBRATED_THRESHOLDS``, looked up by ``prime_node.ml.engines``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from crypto import toploc
from crypto.toploc import ChunkCheck, Thresholds

if TYPE_CHECKING:
    import torch


def bf16_bits(hidden: torch.Tensor) -> np.ndarray:
    """uint16 [n, hidden]: the bf16 bit patterns of a float hidden-state matrix (torch's rounding)."""
    import torch

    if hidden.dim() != 2:
        raise ValueError(f"hidden states must be [tokens, hidden], got shape {tuple(hidden.shape)}")
    as_bf16 = hidden.detach().to("cpu", torch.bfloat16).contiguous()
    bits: np.ndarray = as_bf16.view(torch.int16).numpy().view(np.uint16)
    return bits


def completion_chunks(hidden: torch.Tensor) -> list[np.ndarray]:
    """The flattened bf16 bits of each chunk of ``CHUNK_TOKENS`` rows (the last may be shorter)."""
    bits = bf16_bits(hidden)
    step = toploc.CHUNK_TOKENS
    return [bits[i : i + step].reshape(-1) for i in range(0, bits.shape[0], step)]


def _entries(hidden: torch.Tensor) -> np.ndarray:
    """[n, hidden] as numpy without a conversion pass: float32 values (``crypto.toploc`` rounds only the
    entries that can reach the top-k, exactly as torch rounds), or bf16 bit patterns. Other dtypes are
    rounded by torch, as before."""
    import torch

    if hidden.dim() != 2:
        raise ValueError(f"hidden states must be [tokens, hidden], got shape {tuple(hidden.shape)}")
    tensor = hidden.detach().cpu()
    if tensor.dtype == torch.float32:
        values: np.ndarray = tensor.contiguous().numpy()
        return values
    if tensor.dtype == torch.bfloat16:
        bits: np.ndarray = tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
        return bits
    return bf16_bits(tensor)


def _chunk_blocks(hiddens: Sequence[torch.Tensor]) -> tuple[list[np.ndarray], list[int]]:
    """Every completion's chunks as 2-D blocks (its full chunks as one view, then its short last chunk),
    and each completion's number of chunks."""
    step = toploc.CHUNK_TOKENS
    blocks: list[np.ndarray] = []
    chunk_counts: list[int] = []
    for hidden in hiddens:
        entries = _entries(hidden)
        tokens = entries.shape[0]
        full = tokens // step
        if full:
            blocks.append(entries[: full * step].reshape(full, -1))
        if tokens % step:
            blocks.append(entries[full * step :].reshape(1, -1))
        chunk_counts.append(-(-tokens // step))
    return blocks, chunk_counts


def build_proofs(hiddens: Sequence[torch.Tensor]) -> list[bytes]:
    """One proof blob per completion; all chunks of all completions are interpolated together."""
    blocks, chunk_counts = _chunk_blocks(hiddens)
    proofs = toploc.commit_points(toploc.select_points(blocks))
    blobs: list[bytes] = []
    start = 0
    for count in chunk_counts:
        blobs.append(b"".join(proofs[start : start + count]))
        start += count
    return blobs


def check_proofs(hiddens: Sequence[torch.Tensor], blobs: Sequence[bytes]) -> list[list[ChunkCheck]]:
    """Per completion, one ChunkCheck per chunk. A malformed blob raises CryptoError (with a reason)."""
    if len(hiddens) != len(blobs):
        raise ValueError("one proof blob per completion")
    flat_proofs = [
        proof
        for hidden, blob in zip(hiddens, blobs, strict=True)
        for proof in toploc.split_proofs(blob, int(hidden.shape[0]))
    ]
    blocks, chunk_counts = _chunk_blocks(hiddens)
    checks = toploc.check_points(toploc.select_points(blocks), flat_proofs)
    out: list[list[ChunkCheck]] = []
    start = 0
    for count in chunk_counts:
        out.append(checks[start : start + count])
        start += count
    return out


def proof_failure(checks: Sequence[ChunkCheck], thresholds: Thresholds) -> str | None:
    """The reason code of the first chunk outside ``thresholds``, or None when every chunk passes."""
    for check in checks:
        reason = thresholds.failure(check)
        if reason is not None:
            return reason
    return None
