"""The TOPLOC commit/check code as it was before the speed-up (issue 11), kept verbatim as a reference.

The tests compare today's ``crypto.toploc`` / ``prime_node.verification.proofs`` against it byte for byte,
and ``benchmarks/toploc_speed.py`` times it as the baseline. Not used by the node.
"""
# ruff: noqa
# mypy: ignore-errors

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
import torch

import numpy as np
import numpy.typing as npt

from crypto.errors import CryptoError

FIELD_PRIME = 65497
CHUNK_TOKENS = 32
TOPK = 128
MIN_MODULUS = (1 << 15) + 1
MAX_INDEX = (1 << 31) - 1
HEADER_BYTES = 2
COEFFICIENT_BYTES = 2
PROOF_BYTES = HEADER_BYTES + COEFFICIENT_BYTES * TOPK

_MAGNITUDE_MASK = 0x7FFF
_EXPONENT_MASK = 0x7F80
_EXPONENT_SHIFT = 7
_MANTISSA_MASK = 0x007F

Int64Array = npt.NDArray[np.int64]
UInt16Array = npt.NDArray[np.uint16]


@dataclass(frozen=True)
class ChunkCheck:
    """How far one committed chunk lies from the validator's own recomputation (bigger is worse)."""

    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float
    compared: int


@dataclass(frozen=True)
class Thresholds:
    """Largest deviations an honest chunk may show; calibrated on honest runs of our engines."""

    max_exp_mismatches: int
    max_mant_err_mean: float
    max_mant_err_median: float

    def failure(self, check: ChunkCheck) -> str | None:
        """The reason code of the first bound ``check`` exceeds, or None when it passes."""
        if check.exp_mismatches > self.max_exp_mismatches:
            return "toploc_exponent_mismatch"
        if not check.mant_err_mean <= self.max_mant_err_mean:
            return "toploc_mantissa_mean"
        if not check.mant_err_median <= self.max_mant_err_median:
            return "toploc_mantissa_median"
        return None


# The reference's published acceptance rule: ≥ 90 of 128 exponents agree, mantissa mean ≤ 10, median ≤ 8.
# It was tuned for cross-GPU, cross-kernel recomputation of bf16 models.
REFERENCE_THRESHOLDS = Thresholds(
    max_exp_mismatches=128 - 90, max_mant_err_mean=10.0, max_mant_err_median=8.0
)


def chunk_entries(n_tokens: int, hidden_size: int, chunk_tokens: int = CHUNK_TOKENS) -> list[int]:
    """Number of hidden-state entries in each chunk of a completion of ``n_tokens`` tokens."""
    if n_tokens < 0 or hidden_size <= 0 or chunk_tokens <= 0:
        raise CryptoError("token count, hidden size and chunk length must be positive", reason="bad_shape")
    full, rest = divmod(n_tokens, chunk_tokens)
    return [chunk_tokens * hidden_size] * full + ([rest * hidden_size] if rest else [])


def split_proofs(blob: bytes, n_tokens: int, chunk_tokens: int = CHUNK_TOKENS) -> list[bytes]:
    """The per-chunk proofs of a completion of ``n_tokens`` tokens from their concatenation."""
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise CryptoError("a proof must be bytes", reason="proof_type")
    if n_tokens < 0 or chunk_tokens <= 0:
        raise CryptoError("token count and chunk length must be positive", reason="bad_shape")
    chunks = -(-n_tokens // chunk_tokens)
    if len(blob) != chunks * PROOF_BYTES:
        reason = "proof_truncated" if len(blob) < chunks * PROOF_BYTES else "proof_too_long"
        raise CryptoError(
            f"{len(blob)} proof bytes for {n_tokens} tokens, expected {chunks} × {PROOF_BYTES}", reason=reason
        )
    data = bytes(blob)
    return [data[i : i + PROOF_BYTES] for i in range(0, len(data), PROOF_BYTES)]


# ---------------------------------------------------------------------------------------------------------
# Field arithmetic, vectorised
# ---------------------------------------------------------------------------------------------------------


@functools.cache
def _inverse_table() -> Int64Array:
    """a⁻¹ mod p for every a in [0, p), by Fermat (a^(p-2)); 0 maps to 0 and is never used as a divisor."""
    base = np.arange(FIELD_PRIME, dtype=np.int64)
    result = np.ones(FIELD_PRIME, dtype=np.int64)
    exponent = FIELD_PRIME - 2
    while exponent:
        if exponent & 1:
            result = result * base % FIELD_PRIME
        base = base * base % FIELD_PRIME
        exponent >>= 1
    result[0] = 0
    result.setflags(write=False)
    return result


def injective_moduli(xs: Int64Array) -> Int64Array:
    """Per row, the largest m in [MIN_MODULUS, FIELD_PRIME] under which the row's values are distinct mod m.

    The reference searches downward from 65497 the same way; reducing indices mod m lets indices of
    any size be points of GF(65497) without two of them landing on the same x.
    """
    xs = _as_points(xs, "xs")
    rows = xs.shape[0]
    ordered = np.sort(xs, axis=1)
    if xs.shape[1] > 1 and bool(np.any(ordered[:, 1:] == ordered[:, :-1])):
        raise CryptoError("interpolation points must have distinct indices", reason="duplicate_points")
    moduli = np.zeros(rows, dtype=np.int64)
    pending = np.arange(rows)
    for modulus in range(FIELD_PRIME, MIN_MODULUS - 1, -1):
        reduced = np.sort(xs[pending] % modulus, axis=1)
        collides = np.any(reduced[:, 1:] == reduced[:, :-1], axis=1)
        moduli[pending[~collides]] = modulus
        pending = pending[collides]
        if pending.size == 0:
            return moduli
    raise CryptoError("no modulus above 2^15 separates these indices", reason="no_injective_modulus")


def interpolate(xs: Int64Array, ys: Int64Array) -> Int64Array:
    """Coefficients (constant term first) of the polynomial through each row's points over GF(65497).

    ``xs`` must be distinct elements of the field in every row. Newton's divided differences, then the
    Newton form expanded Horner-style (Q ← dd_i + (x − x_i)·Q) into the monomial basis. Every step is
    one numpy operation over all rows at once, on float64 holding exact integers (see ``_reduce``).
    """
    xs = _as_points(xs, "xs")
    ys = np.asarray(ys, dtype=np.int64)
    if ys.shape != xs.shape:
        raise CryptoError("xs and ys must have the same shape", reason="bad_shape")
    if bool(np.any(xs >= FIELD_PRIME)):
        raise CryptoError("interpolation x outside GF(65497)", reason="bad_points")
    ordered = np.sort(xs, axis=1)
    if bool(np.any(ordered[:, 1:] == ordered[:, :-1])):
        raise CryptoError("interpolation points must have distinct x", reason="duplicate_points")
    blocks = [
        _interpolate_block(xs[i : i + _BLOCK_ROWS], ys[i : i + _BLOCK_ROWS])
        for i in range(0, len(xs), _BLOCK_ROWS)
    ]
    result: Int64Array = np.concatenate(blocks)
    return result


# Rows per vectorised block: large enough to amortise numpy's per-call cost, small enough to stay in cache.
_BLOCK_ROWS = 256


def _reduce(values: npt.NDArray[np.float64], scratch: npt.NDArray[np.float64]) -> None:
    """In place: values (exact integers, |v| < 2^52) → a representative in [0, p] of the same class.

    floor(v / p) computed as floor(v · (1/p)) is exact except when v is a multiple of p, where it may
    come out one low and leave p instead of 0, which is still the right residue. Integer % costs ~3 ns
    per element here; these four float passes cost ~1.
    """
    np.multiply(values, _INVERSE_PRIME, out=scratch)
    np.floor(scratch, out=scratch)
    scratch *= FIELD_PRIME
    values -= scratch


_INVERSE_PRIME = 1.0 / FIELD_PRIME


def _interpolate_block(xs: Int64Array, ys: Int64Array) -> Int64Array:
    k = xs.shape[1]
    inverse = _inverse_table_f64()
    current = (ys % FIELD_PRIME).astype(np.float64)
    following = np.empty_like(current)
    scratch = np.empty_like(current)
    dd = np.empty_like(current)  # Newton coefficients: dd[:, i] = f[x_0, ..., x_i]
    dd[:, 0] = current[:, 0]
    # Divided differences: after pass `gap`, current[:, j] ≡ f[x_j, ..., x_{j+gap}]; its first column is
    # the next Newton coefficient. A negative x difference indexes the inverse table from its end, which
    # is exactly its residue mod p. Reduction is lazy: from residues in [0, p] one pass yields
    # |v| < p² < 2^32, a second |v| < 2^49, still exact in float64; so only every other pass reduces
    # (a reduction costs four passes over the data).
    for gap in range(1, k):
        width = k - gap
        diff = following[:, :width]
        np.subtract(current[:, 1 : width + 1], current[:, :width], out=diff)
        diff *= inverse[xs[:, gap:] - xs[:, :width]]
        if gap % 2 == 0:
            _reduce(diff, scratch[:, :width])
        dd[:, gap] = diff[:, 0]
        current, following = following, current
    _reduce(dd, scratch)
    # Q = dd_{k-1}; for i = k-2 … 0: Q ← dd_i + (x − x_i)·Q. Q's coefficients are constant-term first.
    # All terms are non-negative; from values ≤ p one step gives < 2^33 and a second < 2^49 (exact), so
    # again only every other step reduces, and the final integer % p finishes the job.
    minus_x = ((-xs) % FIELD_PRIME).astype(np.float64)
    poly = np.zeros_like(dd)
    nxt = np.zeros_like(dd)
    poly[:, 0] = dd[:, k - 1]
    for i in range(k - 2, -1, -1):
        degree = k - 2 - i
        np.multiply(poly[:, : degree + 1], minus_x[:, i : i + 1], out=nxt[:, : degree + 1])
        nxt[:, degree + 1] = poly[:, degree]
        nxt[:, 1 : degree + 1] += poly[:, :degree]
        nxt[:, 0] += dd[:, i]
        if degree % 2 == 1:
            _reduce(nxt[:, : degree + 2], scratch[:, : degree + 2])
        poly, nxt = nxt, poly
    result: Int64Array = poly.astype(np.int64) % FIELD_PRIME
    return result


@functools.cache
def _inverse_table_f64() -> npt.NDArray[np.float64]:
    table = _inverse_table().astype(np.float64)
    table.setflags(write=False)
    return table


def evaluate(coefficients: Int64Array, xs: Int64Array) -> Int64Array:
    """P_r(xs[r, j]) mod p for every row r (Horner's rule over all rows and points at once)."""
    coefficients = np.asarray(coefficients, dtype=np.int64)
    xs = np.asarray(xs, dtype=np.int64)
    if coefficients.ndim != 2 or xs.ndim != 2 or xs.shape[0] != coefficients.shape[0]:
        raise CryptoError("coefficients and points must be 2-D, one row per polynomial", reason="bad_shape")
    blocks = [
        _evaluate_block(coefficients[i : i + _BLOCK_ROWS], xs[i : i + _BLOCK_ROWS])
        for i in range(0, max(len(xs), 1), _BLOCK_ROWS)
    ]
    result: Int64Array = np.concatenate(blocks)
    return result


def _evaluate_block(coefficients: Int64Array, xs: Int64Array) -> Int64Array:
    points = (xs % FIELD_PRIME).astype(np.float64)
    coeffs = (coefficients % FIELD_PRIME).astype(np.float64)
    acc = np.repeat(coeffs[:, -1:], xs.shape[1], axis=1)
    scratch = np.empty_like(acc)
    # Non-negative throughout; from ≤ p one step gives < 2^32 and a second < 2^48: reduce every other.
    for step, i in enumerate(range(coeffs.shape[1] - 2, -1, -1)):
        acc *= points
        acc += coeffs[:, i : i + 1]
        if step % 2 == 1:
            _reduce(acc, scratch)
    result: Int64Array = acc.astype(np.int64) % FIELD_PRIME
    return result


def _as_points(xs: Int64Array, name: str) -> Int64Array:
    array = np.asarray(xs, dtype=np.int64)
    if array.ndim != 2 or array.shape[1] == 0:
        raise CryptoError(f"{name} must be a non-empty 2-D array (rows × points)", reason="bad_shape")
    if bool(np.any(array < 0)) or bool(np.any(array > MAX_INDEX)):
        raise CryptoError(f"{name} must lie in [0, 2^31)", reason="bad_points")
    return array


# ---------------------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------------------


def encode_proofs(moduli: Int64Array, coefficients: Int64Array) -> list[bytes]:
    """One proof per row: u16 modulus then the coefficients, all big-endian (the reference layout)."""
    table = np.concatenate([np.asarray(moduli, dtype=np.int64)[:, None], coefficients], axis=1)
    if bool(np.any(table < 0)) or bool(np.any(table > 0xFFFF)):
        raise CryptoError("modulus or coefficient does not fit in 16 bits", reason="bad_points")
    raw = table.astype(">u2").tobytes()
    width = 2 * table.shape[1]
    return [raw[i : i + width] for i in range(0, len(raw), width)]


def decode_proof(data: bytes, topk: int = TOPK) -> tuple[int, Int64Array]:
    """(modulus, coefficients) of one chunk proof; any other bytes are a CryptoError with a reason."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CryptoError("a proof must be bytes", reason="proof_type")
    expected = HEADER_BYTES + COEFFICIENT_BYTES * topk
    if len(data) != expected:
        reason = "proof_truncated" if len(data) < expected else "proof_too_long"
        raise CryptoError(f"proof has {len(data)} bytes, expected {expected}", reason=reason)
    words = np.frombuffer(bytes(data), dtype=">u2").astype(np.int64)
    modulus = int(words[0])
    if not MIN_MODULUS <= modulus <= FIELD_PRIME:
        raise CryptoError(
            f"proof modulus {modulus} outside ({1 << 15}, {FIELD_PRIME}]", reason="proof_modulus"
        )
    coefficients = words[1:]
    if bool(np.any(coefficients >= FIELD_PRIME)):
        raise CryptoError("proof coefficient outside GF(65497)", reason="proof_coefficient")
    return modulus, coefficients


# ---------------------------------------------------------------------------------------------------------
# Commit and check
# ---------------------------------------------------------------------------------------------------------


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
    # magnitude in the high bits, (n − 1 − index) in the low ones; int32 while the index fits 16 bits.
    wide = n > 1 << 16
    dtype: type[np.signedinteger[Any]] = np.int64 if wide else np.int32
    magnitude = (bits & _MAGNITUDE_MASK).astype(dtype)
    key = np.left_shift(magnitude, 32 if wide else 16) | np.arange(n - 1, -1, -1, dtype=dtype)
    part = np.argpartition(key, n - k, axis=1)[:, n - k :]
    chosen = np.take_along_axis(key, part, axis=1)
    order = np.argsort(chosen, axis=1)[:, ::-1]
    result: Int64Array = np.take_along_axis(part, order, axis=1).astype(np.int64)
    return result


def commit_chunks(chunks: Sequence[UInt16Array], topk: int = TOPK) -> list[bytes]:
    """The proof of every chunk, each chunk given as its flattened bf16 bit patterns (uint16).

    Top-k selection runs once per distinct chunk length; the interpolation, the expensive part, runs
    once over all chunks together (each has exactly ``topk`` points after padding).
    """
    if not chunks:
        return []
    xs = np.empty((len(chunks), topk), dtype=np.int64)
    ys = np.zeros((len(chunks), topk), dtype=np.int64)
    for length, positions in _group_by_length(chunks).items():
        bits = np.stack([chunks[i] for i in positions])
        k = min(topk, length)
        chosen = top_entries(bits, k)
        rows = np.asarray(positions)
        xs[rows, :k] = chosen
        ys[rows, :k] = np.take_along_axis(bits, chosen, axis=1)
        # Fewer entries than k: pad with (e, 0) for the indices e the chunk does not have.
        xs[rows, k:] = np.arange(length, topk, dtype=np.int64)
    moduli = injective_moduli(xs)
    return encode_proofs(moduli, interpolate(xs % moduli[:, None], ys))


def check_chunks(
    chunks: Sequence[UInt16Array], proofs: Sequence[bytes], topk: int = TOPK
) -> list[ChunkCheck]:
    """Compare each committed proof with the validator's own recomputed chunk (reference rules).

    A malformed proof raises CryptoError; a well-formed proof of other values just scores badly.
    """
    if len(chunks) != len(proofs):
        raise CryptoError(f"{len(proofs)} proofs for {len(chunks)} chunks", reason="proof_count")
    if not chunks:
        return []
    decoded = [decode_proof(proof, topk) for proof in proofs]
    moduli = np.array([modulus for modulus, _ in decoded], dtype=np.int64)
    coefficients = np.stack([coeffs for _, coeffs in decoded])
    xs = np.zeros((len(chunks), topk), dtype=np.int64)
    own = np.zeros((len(chunks), topk), dtype=np.int64)
    counts = np.empty(len(chunks), dtype=np.int64)
    for length, positions in _group_by_length(chunks).items():
        bits = np.stack([chunks[i] for i in positions])
        k = min(topk, length)
        chosen = top_entries(bits, k)
        rows = np.asarray(positions)
        xs[rows, :k] = chosen
        own[rows, :k] = np.take_along_axis(bits, chosen, axis=1)
        counts[rows] = k
    claimed = evaluate(coefficients, xs % moduli[:, None])
    return [compare_bits(claimed[row, :count], own[row, :count]) for row, count in enumerate(counts.tolist())]


def compare_bits(claimed: Int64Array, own: Int64Array) -> ChunkCheck:
    """Reference comparison of two vectors of bf16 bit patterns: exponent mismatches, mantissa errors."""
    exp_claimed = (claimed & _EXPONENT_MASK) >> _EXPONENT_SHIFT
    exp_own = (own & _EXPONENT_MASK) >> _EXPONENT_SHIFT
    same = exp_claimed == exp_own
    errors = np.sort(np.abs((claimed & _MANTISSA_MASK) - (own & _MANTISSA_MASK))[same])
    if errors.size == 0:
        return ChunkCheck(int(own.size), math.inf, math.inf, int(own.size))
    return ChunkCheck(
        exp_mismatches=int(own.size - errors.size),
        mant_err_mean=float(errors.mean()),
        mant_err_median=float(errors[errors.size // 2]),
        compared=int(own.size),
    )


def _group_by_length(chunks: Sequence[UInt16Array]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for position, chunk in enumerate(chunks):
        array = np.asarray(chunk)
        if array.dtype != np.uint16 or array.ndim != 1 or array.size == 0:
            raise CryptoError("each chunk must be a non-empty 1-D uint16 array", reason="bad_shape")
        groups.setdefault(array.size, []).append(position)
    return groups


# ---- prime_node/verification/proofs.py (torch side) ----


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
    step = CHUNK_TOKENS
    return [bits[i : i + step].reshape(-1) for i in range(0, bits.shape[0], step)]


def build_proofs(hiddens: Sequence[torch.Tensor]) -> list[bytes]:
    """One proof blob per completion; all chunks of all completions are interpolated together."""
    per_completion = [completion_chunks(hidden) for hidden in hiddens]
    flat = [chunk for chunks in per_completion for chunk in chunks]
    proofs = commit_chunks(flat)
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
        for proof in split_proofs(blob, int(hidden.shape[0]))
    ]
    checks = check_chunks(flat_chunks, flat_proofs)
    out: list[list[ChunkCheck]] = []
    start = 0
    for chunks in per_completion:
        out.append(checks[start : start + len(chunks)])
        start += len(chunks)
    return out
