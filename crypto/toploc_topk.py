"""TOPLOC's point selection: the k largest-magnitude bf16 entries of each chunk, deterministically.

Magnitude first (``bits & 0x7FFF`` orders bf16 magnitudes exactly), then the lower index, so two honest
parties with identical bf16 tensors pick identical sets even when magnitudes tie (bf16 ties are common).
Wide chunks are pre-filtered before the top-k (a threshold from a strided sample keeps a few times k
candidates; float32 input is rounded to bf16 only for those). Pure: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from crypto.errors import CryptoError
from crypto.toploc_field import Int64Array

UInt16Array = npt.NDArray[np.uint16]
_MAGNITUDE_MASK = 0x7FFF


def top_entries(bits: UInt16Array, k: int) -> Int64Array:
    """Indices of the k largest-magnitude bf16 entries of each row; ties go to the lower index.

    The key (magnitude, −index) is unique per entry, so the chosen set does not depend on how a
    partition algorithm breaks ties. Rows come back sorted by descending key.
    """
    bits = np.asarray(bits)
    if bits.dtype != np.uint16 or bits.ndim != 2:
        raise CryptoError("bf16 bit patterns must be a 2-D uint16 array", reason="bad_shape")
    n = bits.shape[1]
    if not 0 < k <= n:
        raise CryptoError(f"cannot pick {k} of {n} entries", reason="bad_shape")
    indices, _ = _top_block(bits, k)
    return indices


def bf16_round(values: FloatArray) -> UInt16Array:
    """bf16 bit patterns of float32 values: round to nearest even, as torch does; every NaN → 0x7FC0.

    (torch's own vectorised CPU kernels give 0xFFFF for NaN, its scalar ones 0x7FC0; an honest model
    produces no NaN, and one fixed answer keeps inferer and validator from depending on CPU features.)
    """
    words = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((words + ((words >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16)
    rounded[(words & 0x7FFFFFFF) > 0x7F800000] = 0x7FC0
    return rounded


def select_points(blocks: Sequence[UInt16Array | FloatArray], topk: int) -> PointSet:
    """The committed points of every row of every block, in order (rows of all blocks concatenated).

    A block is 2-D, one chunk per row: bf16 bit patterns (uint16), or float32 values, which are rounded
    to bf16 here (``bf16_round``; only the entries that can reach the top-k are ever rounded). Blocks
    of equal width are processed together.
    """
    blocks = [_checked_block(block) for block in blocks]
    sizes = [block.shape[0] for block in blocks]
    total = sum(sizes)
    xs = np.empty((total, topk), dtype=np.int64)
    ys = np.zeros((total, topk), dtype=np.int64)
    counts = np.empty(total, dtype=np.int64)
    offsets = np.cumsum([0, *sizes])
    scratch: dict[str, npt.NDArray[Any]] = {}
    groups: dict[tuple[int, str], list[int]] = {}
    for position, block in enumerate(blocks):
        if sizes[position]:
            groups.setdefault((block.shape[1], block.dtype.str), []).append(position)
    for (width, _), positions in groups.items():
        k = min(topk, width)
        rows_of = [np.arange(offsets[p], offsets[p + 1]) for p in positions]
        members = [blocks[p] for p in positions]
        if len(members) > 1 and width * sum(sizes[p] for p in positions) <= _STACK_ENTRIES:
            members, rows_of = (
                [cast("UInt16Array | FloatArray", np.concatenate(members))],
                [np.concatenate(rows_of)],
            )
        for block, rows in zip(members, rows_of, strict=True):
            step = max(1, _STACK_ENTRIES // width)  # bounds the temporaries
            for i in range(0, block.shape[0], step):
                chosen, values = _top_block(block[i : i + step], k, scratch)
                target = rows[i : i + step]
                xs[target, :k] = chosen
                ys[target, :k] = values
        # Fewer entries than k: pad with (e, 0) for the indices e the chunk does not have.
        every = np.concatenate(rows_of)
        xs[every, k:] = np.arange(width, topk, dtype=np.int64)
        counts[every] = k
    return PointSet(xs, ys, counts)


@dataclass(frozen=True)
class PointSet:
    """Per chunk: ``xs`` the chosen flat indices (padded to k), ``ys`` their bf16 bits, ``counts`` how
    many of the k are real entries."""

    xs: Int64Array
    ys: Int64Array
    counts: Int64Array


FloatArray = npt.NDArray[np.float32]

# Below this many entries per row a full sort-free partition of the row is as cheap as pre-filtering.
_PREFILTER_ENTRIES = 4096
# Threshold sample: every 17th entry (17 is odd, so a power-of-two hidden size does not alias it onto a
# few channels); its (3k/17)-th largest magnitude leaves ~3k candidates per row on average.
_SAMPLE_STRIDE = 17
# Rows (of equal width) processed per vectorised step; keeps temporaries at a few MiB.
_STACK_ENTRIES = 1 << 20


def _top_block(
    values: UInt16Array | FloatArray, k: int, scratch: dict[str, npt.NDArray[Any]] | None = None
) -> tuple[Int64Array, Int64Array]:
    """(indices, bf16 bits) of the top-k entries of each row, in descending (magnitude, −index) order.

    Wide rows are pre-filtered: a threshold from a strided sample of the row keeps only the entries
    whose bf16 magnitude reaches it (a few times k of them); when at least k entries pass, the top k
    are among them, and the exact selection runs on those alone. Rows where fewer pass (or the
    threshold is degenerate) take the exact path over all their entries. Same result either way.
    """
    width = values.shape[1]
    is_float = values.dtype == np.float32
    if width < _PREFILTER_ENTRIES:
        bits = _bits_of(values)
        chosen = _top_exact(bits, k)
        return chosen, np.take_along_axis(bits, chosen, axis=1).astype(np.int64)
    # Magnitudes as unsigned integers, which order like the values: bf16 bits without the sign, or
    # float32 bits without the sign (NaN above infinity, as bf16 NaN is). Written into reused buffers:
    # fresh multi-MiB temporaries cost more in page faults than the arithmetic.
    rows_n = values.shape[0]
    passing = _scratch(scratch, np.bool_, values.size).reshape(values.shape)
    if is_float:
        magnitude: npt.NDArray[Any] = _scratch(scratch, np.uint32, values.size).reshape(values.shape)
        np.bitwise_and(values.view(np.uint32), np.uint32(0x7FFFFFFF), out=magnitude)
    else:
        magnitude = _scratch(scratch, np.uint16, values.size).reshape(values.shape)
        np.bitwise_and(values.view(np.uint16), np.uint16(_MAGNITUDE_MASK), out=magnitude)
    cut_values = _cuts(magnitude, k, is_float)
    # A degenerate row (threshold 0 or NaN) lets nothing pass and takes the exact path below.
    np.greater_equal(magnitude, cut_values[:, None], out=passing)
    flat = np.flatnonzero(passing)
    row_of = flat // width
    counts = np.bincount(row_of, minlength=rows_n)
    good = (counts >= k) & (counts <= width // 4)
    chosen = np.empty((rows_n, k), dtype=np.int64)
    picked = np.empty((rows_n, k), dtype=np.int64)
    if not bool(good.all()):
        rest = np.flatnonzero(~good)
        bits = _bits_of(values[rest])
        chosen[rest] = _top_exact(bits, k)
        picked[rest] = np.take_along_axis(bits, chosen[rest], axis=1)
    if bool(good.any()):
        rows = np.flatnonzero(good)
        keep = good[row_of]
        flat, row_of = flat[keep], row_of[keep]
        column = flat - row_of * width
        candidate_bits = _bits_of(values[row_of, column]).astype(np.int64)
        keys = ((candidate_bits & _MAGNITUDE_MASK) << 32) | (width - 1 - column)
        per_row = counts[rows]
        starts = np.cumsum(per_row) - per_row
        slot = np.arange(flat.size) - np.repeat(starts, per_row)
        table = np.full((rows.size, int(per_row.max())), -1, dtype=np.int64)
        table[np.repeat(np.arange(rows.size), per_row), slot] = keys
        flat_best = starts[:, None] + _top_keys(table, k)
        chosen[rows] = column[flat_best]
        picked[rows] = candidate_bits[flat_best]
    return chosen, picked


def _cuts(magnitude: npt.NDArray[Any], k: int, is_float: bool) -> npt.NDArray[Any]:
    """Per row, the magnitude an entry must reach to stay a top-k candidate (same dtype as ``magnitude``);
    the dtype's maximum (nothing passes) where the sample gives no usable threshold."""
    sample = magnitude[:, ::_SAMPLE_STRIDE]
    rank = max(1, (3 * k) // _SAMPLE_STRIDE)
    threshold = np.partition(sample, sample.shape[1] - rank, axis=1)[:, sample.shape[1] - rank]
    if is_float:
        # The bf16 magnitude b the sample threshold rounds to; then the smallest float32 magnitude that
        # rounds to b (to nearest even: a halfway value rounds up onto an even b only), so that
        # |x| ≥ cut ⇔ bf16(|x|) ≥ b.
        word = threshold.astype(np.int64)
        level = (word + ((word >> 16) & 1) + 0x7FFF) >> 16
        degenerate = (level == 0) | (word > 0x7F800000)
        level = np.maximum(level, 1)
        cut = ((level - 1) << 16) | np.where(level % 2 == 0, 0x8000, 0x8001)
        return np.where(degenerate, 0xFFFFFFFF, cut).astype(np.uint32)
    degenerate = threshold == 0
    return np.where(degenerate, 0xFFFF, threshold).astype(np.uint16)


def _scratch(buffers: dict[str, npt.NDArray[Any]] | None, dtype: Any, size: int) -> npt.NDArray[Any]:
    """A 1-D buffer of ``size`` elements, reused from ``buffers`` when one of that dtype is big enough."""
    key = np.dtype(dtype).str
    if buffers is not None:
        found = buffers.get(key)
        if found is not None and found.size >= size:
            return found[:size]
    fresh = np.empty(size, dtype=dtype)
    if buffers is not None:
        buffers[key] = fresh
    return fresh


def _top_keys(keys: npt.NDArray[Any], k: int) -> Int64Array:
    """Column positions of the k largest keys of each row, largest first (keys are unique per row)."""
    n = keys.shape[1]
    part = np.argpartition(keys, n - k, axis=1)[:, n - k :]
    order = np.argsort(np.take_along_axis(keys, part, axis=1), axis=1)[:, ::-1]
    result: Int64Array = np.take_along_axis(part, order, axis=1).astype(np.int64)
    return result


def _top_exact(bits: UInt16Array, k: int) -> Int64Array:
    n = bits.shape[1]
    # magnitude in the high bits, (n − 1 − index) in the low ones; int32 while the index fits 16 bits.
    wide = n > 1 << 16
    dtype: type[np.signedinteger[Any]] = np.int64 if wide else np.int32
    magnitude = (bits & _MAGNITUDE_MASK).astype(dtype)
    key = np.left_shift(magnitude, 32 if wide else 16) | np.arange(n - 1, -1, -1, dtype=dtype)
    return _top_keys(key, k)


def _checked_block(block: UInt16Array | FloatArray) -> UInt16Array | FloatArray:
    array = np.ascontiguousarray(block)
    if array.dtype not in (np.uint16, np.float32) or array.ndim != 2 or array.shape[1] == 0:
        raise CryptoError("a block must be 2-D bf16 bits (uint16) or float32 values", reason="bad_shape")
    return cast("UInt16Array | FloatArray", array)


def _bits_of(values: UInt16Array | FloatArray) -> UInt16Array:
    if values.dtype == np.float32:
        return bf16_round(values.astype(np.float32, copy=False))
    return values.astype(np.uint16, copy=False)
