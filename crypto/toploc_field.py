"""TOPLOC's field arithmetic: interpolation and evaluation of polynomials over GF(65497), vectorised.

A chunk's committed points (flat index, bf16 bits) lie on the unique polynomial of degree < k through
them. Indices are first reduced modulo a per-chunk modulus in (2**15, 65497] chosen so they stay distinct
(``injective_moduli``). Everything runs on numpy with exact integers in float64, many chunks at once; chunks
of at most k entries, whose points are always {0, …, k−1}, are interpolated with one matrix product
against a precomputed basis (crypto/toploc.py has the scheme). Pure: no I/O, no torch.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

from crypto.errors import CryptoError

FIELD_PRIME = 65497
MIN_MODULUS = (1 << 15) + 1
MAX_INDEX = (1 << 31) - 1
Int64Array = npt.NDArray[np.int64]


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
