"""TOPLOC proofs from the engine's final hidden states, and their check against a validator's prefill.

The inferer passes ``Completion.hidden`` (float32 [n_tokens, hidden], row t = the final hidden state at
the position that predicted token t) and gets one proof blob per completion: 258 bytes per started
chunk of 32 tokens, the layout of ``crypto.toploc``. The validator passes ``Prefill.hidden`` for the
same tokens and gets one ``ChunkCheck`` per chunk. Rounding to bf16 (round to nearest even, as torch
does) happens in ``crypto.toploc`` and only for the entries that can reach the top-k, so both sides
commit to and compare the same bit patterns without converting whole hidden-state matrices; all the
arithmetic is the pure numpy code in ``crypto.toploc``. The acceptance bounds are calibrated per engine
family and dtype (``crypto.toploc.CALIBRATED_THRESHOLDS``, looked up by ``prime_node.ml.engines``).

Hidden states on a GPU stay there: the top-k of each chunk is taken on the device (``device_points``, the
same (magnitude, lower index) order as ``crypto.toploc``) and only the k chosen (index, bits) pairs per
chunk cross to the host, in one copy per batch instead of the whole [tokens, hidden] matrices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from crypto import toploc, toploc_topk
from crypto.toploc import ChunkCheck, Thresholds
from crypto.toploc_topk import PointSet

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
    widened to float32 first (exact for float16), so NaN rounds to one pattern whatever the CPU."""
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
    widened: np.ndarray = tensor.float().contiguous().numpy()
    return widened


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


_BF16_NAN_BITS = 0x7FC0  # crypto.toploc_topk.bf16_round's one NaN pattern
_DEVICE_BLOCK_ENTRIES = 1 << 24  # entries ranked at once on the device: bounds the int64 keys to 128 MiB


def device_points(hiddens: Sequence[torch.Tensor]) -> PointSet:
    """The committed points of every chunk, chosen with torch on the tensors' own device: the same
    ``PointSet`` as ``crypto.toploc_topk.select_points`` of ``_chunk_blocks`` (tested), but only k indices and
    bit patterns per chunk are copied to the host, once for the whole batch."""
    import torch

    step, topk = toploc.CHUNK_TOKENS, toploc.TOPK
    rows: list[torch.Tensor] = []  # per chunk: k indices, the count of real entries, k bit patterns
    for hidden in hiddens:
        if hidden.dim() != 2:
            raise ValueError(f"hidden states must be [tokens, hidden], got shape {tuple(hidden.shape)}")
        bits = _device_bf16_bits(hidden.detach())
        tokens = bits.shape[0]
        full = tokens // step
        blocks = [bits[: full * step].reshape(full, -1)] if full else []
        if tokens % step:
            blocks.append(bits[full * step :].reshape(1, -1))
        for block in blocks:
            width = block.shape[1]
            k = min(topk, width)
            low = torch.arange(width - 1, -1, -1, device=block.device, dtype=torch.int64)
            for start in range(0, block.shape[0], max(1, _DEVICE_BLOCK_ENTRIES // width)):
                part = block[start : start + max(1, _DEVICE_BLOCK_ENTRIES // width)]
                keys = ((part & 0x7FFF) << 32) | low  # unique per row: the order has no ties to break
                chosen = torch.topk(keys, k, dim=1, largest=True, sorted=True).indices
                picked = torch.gather(part, 1, chosen)
                if k < topk:  # fewer entries than k: (index e, value 0) for the indices e the chunk lacks
                    pad = torch.arange(width, topk, device=part.device, dtype=torch.int64)
                    chosen = torch.cat([chosen, pad.expand(part.shape[0], -1)], dim=1)
                    picked = torch.cat([picked, torch.zeros_like(pad).expand(part.shape[0], -1)], dim=1)
                rows.append(torch.cat([chosen, torch.full_like(chosen[:, :1], k), picked], dim=1))
    if not rows:
        empty = np.empty((0, topk), dtype=np.int64)
        return PointSet(empty, empty.copy(), np.empty(0, dtype=np.int64))
    host = torch.cat(rows).cpu().numpy()
    return PointSet(
        np.ascontiguousarray(host[:, :topk]),
        np.ascontiguousarray(host[:, topk + 1 :]),
        np.ascontiguousarray(host[:, topk]),
    )


def _device_bf16_bits(hidden: torch.Tensor) -> torch.Tensor:
    """int64 [n, hidden] holding the bf16 bit patterns (0..65535) of ``hidden``, on its device: torch's
    round to nearest even, and every NaN as ``crypto.toploc_topk.bf16_round`` writes it."""
    import torch

    as_bf16 = hidden if hidden.dtype == torch.bfloat16 else hidden.to(torch.bfloat16)
    bits = as_bf16.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    if hidden.dtype != torch.bfloat16:
        bits = torch.where(torch.isnan(hidden), torch.full_like(bits, _BF16_NAN_BITS), bits)
    return bits


def select_points(hiddens: Sequence[torch.Tensor]) -> PointSet:
    """Every chunk's committed points: on the device for GPU tensors, with numpy for CPU ones."""
    if any(hidden.device.type != "cpu" for hidden in hiddens):
        return device_points(hiddens)
    blocks, _ = _chunk_blocks(hiddens)
    return toploc_topk.select_points(blocks, toploc.TOPK)


def _chunk_counts(hiddens: Sequence[torch.Tensor]) -> list[int]:
    return [-(-int(hidden.shape[0]) // toploc.CHUNK_TOKENS) for hidden in hiddens]


def build_proofs(hiddens: Sequence[torch.Tensor]) -> list[bytes]:
    """One proof blob per completion; all chunks of all completions are interpolated together."""
    chunk_counts = _chunk_counts(hiddens)
    proofs = toploc.commit_points(select_points(hiddens))
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
    chunk_counts = _chunk_counts(hiddens)
    checks = toploc.check_points(select_points(hiddens), flat_proofs)
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
