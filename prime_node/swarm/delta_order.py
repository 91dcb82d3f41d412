"""Which elements of a chunk a record codes, and in what order: both derived from the base alone.

Whether a float value changes in a step, and by how many representable steps, depends mostly on its
magnitude (an update of a given size is many steps for a small value, often none for a large one), so
grouping values by the base value's exponent makes the gaps between changed values and the changes alike.
Version 1 sorted every chunk by exponent (``visit``: a stable sort, 25-35 ms of CPU per 2M values here,
most of the codec's time); version 2 cuts the exponents into a few ranges, **tiers** (``tier_mask``), and
codes a tier's changes by their rank among its members in file order: a compare or two per tier, no sort.
docs/deltas.md measures both.
"""

from __future__ import annotations

import numpy as np

from prime_node.swarm.delta_format import Tensor


def exponents(bits: np.ndarray, tensor: Tensor) -> np.ndarray:
    """The exponent field of each element (0 for anything but a float): bytes where it fits in 8 bits
    (the compares on it then read a quarter or half the memory)."""
    if not tensor.floating:
        return np.zeros(len(bits), dtype=np.uint8)
    kind = bits.dtype.type
    found: np.ndarray = bits >> kind(tensor.mantissa_bits)
    if tensor.exponent_bits == 8:  # the sign sits just above: a cast to bytes drops it
        return found.astype(np.uint8)
    found &= kind((1 << tensor.exponent_bits) - 1)
    return found if tensor.exponent_bits > 8 else found.astype(np.uint8)


def tier_mask(exponent: np.ndarray, low: int, high: int, tensor: Tensor) -> np.ndarray | None:
    """Where ``low <= exponent < high`` (booleans), or None where that is every element."""
    top = 1 << tensor.exponent_bits
    if low == 0 and high >= top:
        return None
    if low == 0:
        return exponent < high
    found: np.ndarray = exponent >= low
    if high < top:
        found &= exponent < high
    return found


def tier_table(bounds: list[int], tensor: Tensor) -> np.ndarray:
    """Each exponent's part of a tiered record (the compiled kernels' tier lookup): the tier holding it,
    or ``len(bounds)`` for the rest."""
    every = np.arange(1 << tensor.exponent_bits)
    found: np.ndarray = np.searchsorted(np.asarray(bounds, dtype=np.int64), every, side="right")
    return found.astype(np.uint8)


def ranks_in(mask: np.ndarray, where: np.ndarray) -> np.ndarray:
    """The rank among the set elements of ``mask`` of each element at ``where`` (positions set in it),
    counted on ``mask``'s packed bits: no list of its members (``flatnonzero`` costs 2-4 ms per 2M
    values at the densities tiers have here, a popcount prefix a fraction of that)."""
    packed = np.packbits(mask, bitorder="little")
    through = np.cumsum(np.bitwise_count(packed), dtype=np.int32)
    byte = where >> 3
    held = packed[byte]
    lower = held & ((np.int64(1) << (where & 7)) - 1).astype(np.uint8)
    ranks: np.ndarray = through[byte] - np.bitwise_count(held) + np.bitwise_count(lower)
    return ranks


def visit_order(old: np.ndarray, tensor: Tensor) -> np.ndarray | None:
    """Version 1's order of a float chunk's elements: stably sorted by the base value's exponent.

    Sorting (exponent << index bits | index) as one unsigned integer gives the same stable order as an
    argsort of the exponents, at half its cost: numpy sorts 32-bit integers with SIMD, and the indices
    come out as 32-bit integers (half the memory traffic of argsort's int64). None: file order.
    """
    if not tensor.floating:
        return None
    order, _ = visit(old, tensor, None)
    return order


def visit(old: np.ndarray, tensor: Tensor, flags: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """A float chunk's version-1 visiting order and, given ``flags`` (booleans in file order), the
    positions in visiting order of the elements flagged: the flag rides in the sort key's lowest bit."""
    extra = 0 if flags is None else 1
    mantissa = tensor.mantissa_bits
    exponent_bits = tensor.exponent_bits
    index_bits = max(1, (len(old) - 1).bit_length()) + extra
    wide = np.uint32 if exponent_bits + index_bits <= 32 else np.uint64
    key: np.ndarray
    if old.dtype.itemsize > np.dtype(wide).itemsize:
        key = (old >> old.dtype.type(mantissa)).astype(wide)
    else:
        key = old.astype(wide)
        key >>= wide(mantissa)
    key &= wide((1 << exponent_bits) - 1)
    key <<= wide(index_bits)
    index: np.ndarray = np.arange(len(old), dtype=wide)
    if flags is not None:
        index <<= wide(1)
        index |= flags
    key |= index
    key.sort()
    found = None if flags is None else np.flatnonzero(key & wide(1))
    key &= wide((1 << index_bits) - 1)
    key >>= wide(extra)
    return key, found


def unvisit(values: np.ndarray, order: np.ndarray | None) -> np.ndarray:
    """Values in visiting order back in file order."""
    if order is None:
        return values
    out = np.empty_like(values)
    out[order] = values
    return out
