"""TOPLOC proofs from the engine's final hidden states, and their check against a validator's prefill.

The inferer passes ``Completion.hidden`` (float32 [n_tokens, hidden], row t = the final hidden state at
the position that predicted token t) and gets one proof blob per completion: 258 bytes per started
chunk of 32 tokens, the layout of ``crypto.toploc``. The validator passes ``Prefill.hidden`` for the
same tokens and gets one ``ChunkCheck`` per chunk. Rounding to bf16 happens here (round to nearest
even, as torch does), so both sides commit to and compare the same bit patterns; all the arithmetic is
the pure numpy code in ``crypto.toploc``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from crypto import toploc
from crypto.toploc import ChunkCheck, Thresholds

if TYPE_CHECKING:
    import torch

# Calibrated on our torch engine (KV-cache generation vs one prefill pass, same machine): every honest
# chunk measured was bit-exact (0 exponent mismatches, mantissa error 0). The bounds leave room for
# recomputation on other hardware without admitting a different model; see docs/verification.md.
ENGINE_THRESHOLDS = Thresholds(max_exp_mismatches=8, max_mant_err_mean=2.0, max_mant_err_median=1.0)


def bf16_bits(hidden: torch.Tensor) -> np.ndarray:
    """uint16 [n, hidden]: the bf16 bit patterns of a float hidden-state matrix."""
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


def build_proofs(hiddens: Sequence[torch.Tensor]) -> list[bytes]:
    """One proof blob per completion; all chunks of all completions are interpolated together."""
    per_completion = [completion_chunks(hidden) for hidden in hiddens]
    flat = [chunk for chunks in per_completion for chunk in chunks]
    proofs = toploc.commit_chunks(flat)
    blobs: list[bytes] = []
    start = 0
    for chunks in per_completion:
        blobs.append(b"".join(proofs[start : start + len(chunks)]))
        start += len(chunks)
    return blobs


def check_proofs(hiddens: Sequence[torch.Tensor], blobs: Sequence[bytes]) -> list[list[ChunkCheck]]:
    """Per completion, one ChunkCheck per chunk. A malformed blob raises CryptoError (with a reason)."""
    if len(hiddens) != len(blobs):
        raise ValueError("one proof blob per completion")
    per_completion = [completion_chunks(hidden) for hidden in hiddens]
    flat_chunks = [chunk for chunks in per_completion for chunk in chunks]
    flat_proofs = [
        proof
        for hidden, blob in zip(hiddens, blobs, strict=True)
        for proof in toploc.split_proofs(blob, int(hidden.shape[0]))
    ]
    checks = toploc.check_chunks(flat_chunks, flat_proofs)
    out: list[list[ChunkCheck]] = []
    start = 0
    for chunks in per_completion:
        out.append(checks[start : start + len(chunks)])
        start += len(chunks)
    return out


def proof_failure(checks: Sequence[ChunkCheck], thresholds: Thresholds = ENGINE_THRESHOLDS) -> str | None:
    """The reason code of the first chunk outside ``thresholds``, or None when every chunk passes."""
    for check in checks:
        reason = thresholds.failure(check)
        if reason is not None:
            return reason
    return None
