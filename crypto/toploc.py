"""TOPLOC commitments: a compact, checkable fingerprint of a model's last hidden states.

TOPLOC (arXiv 2501.16007) lets a validator check that a completion came from the claimed model without
storing activations. For every chunk of up to ``CHUNK_TOKENS`` generated tokens the prover takes the
flattened last hidden states of those tokens as bf16, picks the ``TOPK`` entries of largest magnitude,
and commits to the points (flat index, bf16 bit pattern) by interpolating the unique polynomial of
degree < k through them over GF(65497). The validator recomputes the hidden states with one prefill,
picks *its own* top-k, evaluates the committed polynomial at its own indices and compares bf16
exponents and mantissas. Small numerical noise moves a few mantissa bits; a different model, prompt or
precision moves exponents of most entries.

Byte layout of one chunk proof (identical to the reference `toploc` 0.1.6 ``ProofPoly.to_bytes``)::

    u16 big-endian  modulus m          the largest m in (2^15, 65497] with the k indices distinct mod m
    k × u16 big-endian  c_0 … c_{k-1}  coefficients over GF(65497), constant term first:
                                        P(x) = Σ c_i x^i  and  P(index mod m) = bf16 bits mod 65497

With k = 128 that is 2 + 256 = 258 bytes, and a completion of n tokens carries ceil(n / 32) of them,
concatenated. A chunk with fewer than k entries (the short final chunk of a model with hidden size
below 128, which the reference refuses outright) commits to all its entries plus padding points
(index e, value 0) for e = entries … k−1, so every proof keeps the fixed 258-byte size; the validator
then compares all ``entries`` values.

The check follows the reference rules: for the validator's k indices, count exponent mismatches (bits
14..7 of bf16; the sign is not compared), and over the entries whose exponents agree take the mean and
the upper median (sorted[n // 2]) of |mantissa difference| (bits 6..0). No matching exponent at all
gives an infinite mean and median. A chunk passes when all three stay within ``Thresholds``.

Top-k selection is deterministic: magnitude first (``bits & 0x7FFF`` orders bf16 magnitudes exactly),
then the lower index, so two honest parties with identical bf16 tensors pick identical sets even when
magnitudes tie (bf16 ties are common).

Everything is vectorised across chunks with numpy (exact integers in float64), so building a batch of
proofs costs a few hundred numpy calls in total, not per chunk. Wide chunks are pre-filtered before the
top-k (a threshold from a strided sample keeps a few times k candidates; float32 input is rounded to
bf16 only for those), and chunks of at most k entries, whose points are always {0, …, k−1}, are
interpolated with one matrix product against a precomputed basis. Pure: no I/O, no torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, cast

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

EngineKey = tuple[str, str, str]
"""(engine family, dtype the engine computes in, device kind "cpu" or "cuda"), e.g.
("torch", "bfloat16", "cuda"): a GPU's kernels (tiling, attention backend, fused ops) are another
engine than a CPU's, so every pair is calibrated per device kind too."""

# Acceptance bounds per (inferer engine, validator engine): each entry is calibrated on honest runs of that
# pair across kernel sets, thread counts, batch sizes and attention backends (benchmarks/
# verification_dtypes.py on CPUs, benchmarks/gpu.py on a GPU; docs/verification.md *Across dtypes and
# machines* and *On a GPU*), and a pair without an entry cannot be validated.
# float32 → float32 (CPU): KV-cache generation vs one prefill pass was bit-exact at the bf16 top-128 level
# in every honest chunk measured, on AVX2 and scalar kernels, 1 or 2 threads (worst mantissa mean 0.008);
# the bounds leave room for other hardware. 1 %-perturbed weights: ≥ 10 exponent mismatches, mean ≥ 3.4.
# A bfloat16 inferer checked in float32 (CPU): honest worst 11 exponent mismatches, mantissa mean ≤ 1.65,
# median ≤ 1 (1,000 batches, 7,962 chunks, native and scalar kernels); 1 %-perturbed weights: mean ≥ 2.9,
# median ≥ 3. The exponent bound is loose (honest and perturbed overlap there); the mantissa bounds catch.
# On an H200 (1,000 honest batches per pair, the GPU side generating 256 samples per engine call with SDPA
# attention, validators prefilling one 4-sample batch at a time with eager attention): cuda bf16 → cuda
# bf16 honest worst mean 1.79 (12 exponent mismatches), cuda bf16 → cpu fp32 1.68 (11), cpu fp32 → cuda
# bf16 1.61 (12); 1 %-perturbed weights ≥ 2.75 in every pair. The bf16 bounds hold with 0 false rejects.
# bfloat16 → bfloat16 on the CPU is not listed: it met the goal on 1,000 batches with the same kernels but
# has only a 150-batch run across kernel sets, short of the 1,000 a supported pair needs.
_F32, _BF16 = ("torch", "float32", "cpu"), ("torch", "bfloat16", "cpu")
_CUDA_BF16 = ("torch", "bfloat16", "cuda")
_BF16_INFERER = Thresholds(max_exp_mismatches=24, max_mant_err_mean=2.0, max_mant_err_median=2.0)
CALIBRATED_THRESHOLDS: Mapping[tuple[EngineKey, EngineKey], Thresholds] = MappingProxyType(
    {
        (_F32, _F32): Thresholds(max_exp_mismatches=8, max_mant_err_mean=2.0, max_mant_err_median=1.0),
        (_BF16, _F32): _BF16_INFERER,
        (_CUDA_BF16, _CUDA_BF16): _BF16_INFERER,
        (_CUDA_BF16, _F32): _BF16_INFERER,
        (_F32, _CUDA_BF16): _BF16_INFERER,
    }
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
    Rows whose points are exactly {0, …, k−1} (every chunk of at most k entries, padded) skip all that:
    their coefficients are one matrix product with the precomputed inverse Vandermonde matrix.
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
    k = xs.shape[1]
    result: Int64Array = np.empty(xs.shape, dtype=np.int64)
    # Distinct non-negative x with maximum k − 1 are exactly {0, …, k − 1}.
    fixed = ordered[:, -1] == k - 1
    if bool(fixed.any()):
        rows = np.flatnonzero(fixed)
        by_x = np.empty((rows.size, k), dtype=np.float64)
        np.put_along_axis(by_x, xs[rows], (ys[rows] % FIELD_PRIME).astype(np.float64), axis=1)
        # Entries below p: every sum of k products stays below 2^39, exact in float64.
        result[rows] = (by_x @ _lagrange_basis(k)).astype(np.int64) % FIELD_PRIME
    general = np.flatnonzero(~fixed)
    for i in range(0, general.size, _BLOCK_ROWS):
        rows = general[i : i + _BLOCK_ROWS]
        result[rows] = _interpolate_block(xs[rows], ys[rows])
    return result


# Rows per vectorised block: large enough to amortise numpy's per-call cost, small enough to stay in cache.
_BLOCK_ROWS = 512


@functools.cache
def _lagrange_basis(k: int) -> npt.NDArray[np.float64]:
    """[x, :] = coefficients of the Lagrange basis polynomial of x over the points {0, …, k − 1}."""
    points = np.tile(np.arange(k, dtype=np.int64), (k, 1))
    table = _interpolate_block(points, np.eye(k, dtype=np.int64)).astype(np.float64)
    table.setflags(write=False)
    return table


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
    # Work transposed, [point, row], so every slice below is one contiguous run of memory.
    k, rows = xs.shape[1], xs.shape[0]
    inverse = _shifted_inverse_table()
    x = np.ascontiguousarray(xs.T)
    x_shifted = x + FIELD_PRIME
    current = np.ascontiguousarray((ys % FIELD_PRIME).T, dtype=np.float64)
    following = np.empty_like(current)
    scratch = np.empty_like(current)
    factors = np.empty((k, rows), dtype=np.uint16)
    gaps = np.empty((k, rows), dtype=np.int64)
    dd = np.empty_like(current)  # Newton coefficients: dd[i] = f[x_0, ..., x_i]
    dd[0] = current[0]
    # Divided differences: after pass `gap`, current[j] ≡ f[x_j, ..., x_{j+gap}]; its first row is the
    # next Newton coefficient. x_{j+gap} − x_j + p indexes the inverse table shifted by p, which is the
    # inverse of its residue. Reduction is lazy: from residues in [0, p] one pass yields |v| < p² < 2^32,
    # a second |v| < 2^49, still exact in float64; so only every other pass reduces (a reduction costs
    # four passes over the data).
    for gap in range(1, k):
        width = k - gap
        diff = following[:width]
        np.subtract(current[1 : width + 1], current[:width], out=diff)
        np.subtract(x_shifted[gap:], x[:width], out=gaps[:width])
        np.take(inverse, gaps[:width], out=factors[:width], mode="clip")
        diff *= factors[:width]
        if gap % 2 == 0:
            _reduce(diff, scratch[:width])
        dd[gap] = diff[0]
        current, following = following, current
    _reduce(dd, scratch)
    # Q = dd_{k-1}; for i = k-2 … 0: Q ← dd_i + (x − x_i)·Q. Q lives in poly[s : k] with its constant
    # term at row s; the product by x is a shift by one row, so the new Q (at s − 1) is
    # poly[s − 1 : k − 1] += (−x_i)·poly[s : k], plus dd_i on its constant term (poly starts at zero).
    # All terms are non-negative; from values ≤ p one step gives < 2^33 and a second < 2^50 (exact), so
    # again only every other step reduces, and the final integer % p finishes the job.
    minus_x = ((-x) % FIELD_PRIME).astype(np.float64)
    poly = np.zeros_like(dd)
    product = following
    poly[k - 1] = dd[k - 1]
    for i in range(k - 2, -1, -1):
        degree = k - 2 - i
        np.multiply(poly[i + 1 :], minus_x[i], out=product[: degree + 1])
        poly[i : k - 1] += product[: degree + 1]
        poly[i] += dd[i]
        if degree % 2 == 1:
            _reduce(poly[i:], scratch[: degree + 2])
    result: Int64Array = np.ascontiguousarray(poly.T).astype(np.int64) % FIELD_PRIME
    return result


@functools.cache
def _shifted_inverse_table() -> npt.NDArray[np.uint16]:
    """[d + p] = (d mod p)⁻¹ for d in (−p, p): the inverse of a difference of two field elements.

    uint16 (256 KiB) rather than float64: the lookups are random, and the smaller table stays in cache."""
    inverse = _inverse_table().astype(np.uint16)
    table = np.concatenate([inverse, inverse])
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


def select_points(blocks: Sequence[UInt16Array | FloatArray], topk: int = TOPK) -> PointSet:
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


def commit_points(points: PointSet) -> list[bytes]:
    """The proof of every chunk from its selected points (``select_points``)."""
    if points.xs.shape[0] == 0:
        return []
    moduli = injective_moduli(points.xs)
    return encode_proofs(moduli, interpolate(points.xs % moduli[:, None], points.ys))


def commit_chunks(chunks: Sequence[UInt16Array], topk: int = TOPK) -> list[bytes]:
    """The proof of every chunk, each chunk given as its flattened bf16 bit patterns (uint16).

    Top-k selection runs once per distinct chunk length; the interpolation, the expensive part, runs
    once over all chunks together (each has exactly ``topk`` points after padding).
    """
    if not chunks:
        return []
    return commit_points(select_points([_as_chunk(chunk)[None, :] for chunk in chunks], topk))


def check_points(points: PointSet, proofs: Sequence[bytes], topk: int = TOPK) -> list[ChunkCheck]:
    """Compare each committed proof with the validator's own points of the same chunk (reference rules).

    A malformed proof raises CryptoError; a well-formed proof of other values just scores badly.
    """
    if points.xs.shape[0] != len(proofs):
        raise CryptoError(f"{len(proofs)} proofs for {points.xs.shape[0]} chunks", reason="proof_count")
    if not proofs:
        return []
    moduli, coefficients = decode_proofs(proofs, topk)
    claimed = evaluate(coefficients, points.xs % moduli[:, None])
    return compare_rows(claimed, points.ys, points.counts)


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
    return check_points(select_points([_as_chunk(chunk)[None, :] for chunk in chunks], topk), proofs, topk)


def decode_proofs(proofs: Sequence[bytes], topk: int = TOPK) -> tuple[Int64Array, Int64Array]:
    """(moduli, coefficients [chunks × k]) of many chunk proofs at once; errors as ``decode_proof``."""
    expected = HEADER_BYTES + COEFFICIENT_BYTES * topk
    if all(isinstance(proof, bytes) and len(proof) == expected for proof in proofs):
        words = np.frombuffer(b"".join(proofs), dtype=">u2").reshape(len(proofs), topk + 1).astype(np.int64)
        moduli, coefficients = words[:, 0], words[:, 1:]
        if bool(np.all((moduli >= MIN_MODULUS) & (moduli <= FIELD_PRIME))) and not bool(
            np.any(coefficients >= FIELD_PRIME)
        ):
            return moduli, coefficients
    decoded = [decode_proof(proof, topk) for proof in proofs]  # raises for the first bad one
    return (
        np.array([modulus for modulus, _ in decoded], dtype=np.int64),
        np.stack([coefficients for _, coefficients in decoded]),
    )


def compare_rows(claimed: Int64Array, own: Int64Array, counts: Int64Array) -> list[ChunkCheck]:
    """``compare_bits`` of every row's first ``counts[row]`` entries, vectorised over the rows."""
    width = own.shape[1]
    real = np.arange(width) < counts[:, None]
    same = real & ((claimed & _EXPONENT_MASK) == (own & _EXPONENT_MASK))
    errors = np.abs((claimed & _MANTISSA_MASK) - (own & _MANTISSA_MASK))
    matched = np.count_nonzero(same, axis=1)
    totals = np.where(same, errors, 0).sum(axis=1)
    ordered = np.sort(np.where(same, errors, _MANTISSA_MASK + 1), axis=1)  # mismatches sort last
    medians = np.take_along_axis(ordered, (matched // 2)[:, None], axis=1)[:, 0]
    checks: list[ChunkCheck] = []
    for count, n, total, median in zip(
        counts.tolist(), matched.tolist(), totals.tolist(), medians.tolist(), strict=True
    ):
        if n == 0:
            checks.append(ChunkCheck(count, math.inf, math.inf, count))
        else:
            checks.append(ChunkCheck(count - n, float(np.float64(total) / n), float(median), count))
    return checks


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


def _as_chunk(chunk: UInt16Array) -> UInt16Array:
    array = np.asarray(chunk)
    if array.dtype != np.uint16 or array.ndim != 1 or array.size == 0:
        raise CryptoError("each chunk must be a non-empty 1-D uint16 array", reason="bad_shape")
    return array


def _checked_block(block: UInt16Array | FloatArray) -> UInt16Array | FloatArray:
    array = np.ascontiguousarray(block)
    if array.dtype not in (np.uint16, np.float32) or array.ndim != 2 or array.shape[1] == 0:
        raise CryptoError("a block must be 2-D bf16 bits (uint16) or float32 values", reason="bad_shape")
    return cast("UInt16Array | FloatArray", array)


def _bits_of(values: UInt16Array | FloatArray) -> UInt16Array:
    if values.dtype == np.float32:
        return bf16_round(values.astype(np.float32, copy=False))
    return values.astype(np.uint16, copy=False)
