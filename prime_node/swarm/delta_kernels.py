"""The codec's per-chunk work compiled (numba): one pass over a chunk's elements where numpy makes ~15.

numpy needs a whole-chunk pass per step (compare, exponents, tier masks, ``flatnonzero``, gathers, the
popcount ranks, the changes, the planes): at 4 MiB a chunk each pass leaves the cache, so the codec ran at
~0.1 GB/s whatever the core. The encoder's kernel walks a chunk once, keeping a counter per tier; the
applier's lists each tier's members in one branch-free pass and puts the changes at the coded ranks (a
walk comparing every member's rank with the next key mispredicted a branch per change: twice the cost).
All release the GIL (the pool's workers run them on every core). They are the format's element coding
and tier passes and nothing else: the plan, the record layout and every check on a delta stay in
``delta_encode``/``delta_apply``, whose numpy code is the reference and the fallback (``delta_select``),
and the records are byte-identical either way (tests/swarm/test_delta_kernels.py).

Arithmetic is on unsigned 64-bit integers masked to the element's width (``ones``), with every constant
typed: numba turns ``uint64`` mixed with a signed integer into a float. Compiled on first use per element
type and cached on disk (``cache=True``): seconds once, a fraction of one from then on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

import numba
import numpy as np

from prime_node.swarm.delta_format import Tensor

_F = TypeVar("_F", bound=Callable[..., Any])
_ZERO = np.uint64(0)
_ONE = np.uint64(1)
_BYTE = np.uint64(0xFF)
_THREE = np.uint64(3)


def _kernel(function: _F) -> _F:
    return cast(_F, numba.njit(nogil=True, cache=True)(function))


class Coding(NamedTuple):
    """A tensor's element coding as the kernels take it."""

    shift: np.uint64  # the exponent field's lowest bit (the mantissa's width)
    exponent_mask: np.uint64  # the field's width in ones; 0 for anything but a float (exponent 0)
    sign: np.uint64  # the element's top bit
    top: np.uint64  # its position
    ones: np.uint64  # every bit of the element
    floating: bool


def coding(tensor: Tensor) -> Coding:
    bits = 8 * tensor.element_size
    return Coding(
        np.uint64(tensor.mantissa_bits),
        np.uint64((1 << tensor.exponent_bits) - 1),
        np.uint64(1 << (bits - 1)),
        np.uint64(bits - 1),
        np.uint64((1 << bits) - 1),
        tensor.floating,
    )


# The element coding of delta_format, one element at a time and without branches on the value (a sign
# or a change's direction is a coin toss: a mispredicted branch costs more than the arithmetic).


@_kernel
def _ordered(bits: Any, coding: Any) -> Any:
    """delta_format._ordered: negatives with every bit flipped, the rest with the sign bit set."""
    _, _, sign, top, ones, floating = coding
    if not floating:
        return bits
    return bits ^ (((_ZERO - (bits >> top)) & ones) | sign)


@_kernel
def _unordered(ordered: Any, coding: Any) -> Any:
    _, _, sign, top, ones, floating = coding
    if not floating:
        return ordered
    return ordered ^ ((((ordered >> top) - _ONE) & ones) | sign)


@_kernel
def _change(old: Any, new: Any, coding: Any) -> Any:
    """delta_format.change: the zigzag-coded difference in value order."""
    top, ones = coding[3], coding[4]
    difference = (_ordered(new, coding) - _ordered(old, coding)) & ones
    return ((difference << _ONE) & ones) ^ ((_ZERO - (difference >> top)) & ones)


@_kernel
def _apply(old: Any, change: Any, coding: Any) -> Any:
    """delta_format.apply_change."""
    ones = coding[4]
    difference = (change >> _ONE) ^ ((_ZERO - (change & _ONE)) & ones)
    return _unordered((_ordered(old, coding) + difference) & ones, coding)


# Hot loops index with unsigned integers or with a loop's own counter: numba wraps a negative signed
# index around, and that check on every access keeps LLVM from vectorising a loop (10x on the planes).
# Planes are written and read one plane at a time (a loop over the elements per byte, vectorised).


@_kernel
def _to_planes(values: Any, width: Any, out: Any) -> Any:
    """delta_format.planes: the low ``width`` bytes of each of ``values``, byte ``k`` of all together."""
    count = len(values)
    for byte in range(width):
        plane = out[byte * count : (byte + 1) * count]
        shift = np.uint64(8 * byte)
        for index in range(count):
            plane[index] = (np.uint64(values[index]) >> shift) & _BYTE


@_kernel
def _from_planes(data: Any, width: Any, values: Any) -> Any:
    """delta_format.unplanes of ``width``-byte planes in ``data`` into ``values``."""
    count = len(values)
    values[:] = 0
    for byte in range(width):
        plane = data[byte * count : (byte + 1) * count]
        shift = np.uint64(8 * byte)
        for index in range(count):
            values[index] |= np.uint64(plane[index]) << shift


@_kernel
def planes(values: Any, out: Any) -> Any:
    """delta_format.planes of ``values`` (unsigned integers of the element's width) into ``out``."""
    _to_planes(values, values.itemsize, out)


@_kernel
def unplanes(data: Any, values: Any) -> Any:
    """delta_format.unplanes of ``data`` into ``values``."""
    _from_planes(data, values.itemsize, values)


@_kernel
def class_counts(old: Any, new: Any, stride: Any, coding: Any, classes: Any) -> Any:
    """Per exponent class, the sampled elements (every ``stride``-th) and those of them that changed:
    the tier plan's ``np.bincount`` pair."""
    shift, exponent_mask = coding[0], coding[1]
    seen = np.zeros(classes, np.int64)
    moved = np.zeros(classes, np.int64)
    for index in range(0, len(old), stride):
        exponent = (np.uint64(old[index]) >> shift) & exponent_mask
        seen[exponent] += 1
        moved[exponent] += old[index] != new[index]
    return seen, moved


@_kernel
def entries(old: Any, new: Any, table: Any, dense: Any, coding: Any, part: Any, key: Any, change: Any) -> Any:
    """The encoder's pass: each element's part from ``table`` (by its base exponent; the last part is
    the rest), and for every change (every member of a ``dense`` tier) its part, key (rank among the
    tier's members, or position in the chunk for the rest) and change appended to ``part``, ``key`` and
    ``change`` (arrays of the chunk's length). Returns how many were appended, how many elements
    changed, and per part the entries and the largest gap between consecutive keys."""
    shift, exponent_mask = coding[0], coding[1]
    parts = len(dense)
    rest = parts - 1
    members = np.zeros(parts, np.uint64)
    found = _ZERO
    changed = 0
    for index in range(len(old)):
        before = np.uint64(old[index])
        after = np.uint64(new[index])
        tier = table[(before >> shift) & exponent_mask]
        rank = members[tier]
        members[tier] = rank + _ONE
        if before != after or dense[tier]:
            changed += before != after
            part[found] = tier
            key[found] = np.uint64(index) if tier == rest else rank
            change[found] = _change(before, after, coding)
            found += _ONE
    counts = np.zeros(parts, np.int64)
    last = np.full(parts, -1, np.int64)
    largest = np.zeros(parts, np.int64)
    for index in range(found):
        tier = part[index]
        at = np.int64(key[index])
        largest[tier] = max(largest[tier], at - last[tier] - 1)
        last[tier] = at
        counts[tier] += 1
    return found, changed, counts, largest


@_kernel
def pack(
    found: Any, part: Any, key: Any, change: Any, counts: Any, gap_widths: Any, offsets: Any, out: Any
) -> Any:
    """Each part's gap planes then change planes, at ``offsets`` in ``out``, from ``entries``' lists:
    the entries gathered part by part, then each part's planes written."""
    parts = len(counts)
    first = np.zeros(parts, np.int64)  # each part's first entry in the gathered arrays
    for tier in range(1, parts):
        first[tier] = first[tier - 1] + counts[tier - 1]
    filled = first.copy()
    last = np.full(parts, -1, np.int64)
    gaps = np.empty(found, np.uint64)
    values = np.empty(found, change.dtype)
    for index in range(found):
        tier = part[index]
        at = filled[tier]
        filled[tier] = at + 1
        here = np.int64(key[index])
        gaps[at] = here - last[tier] - 1
        last[tier] = here
        values[at] = change[index]
    for tier in range(parts):
        count = counts[tier]
        start = offsets[tier]
        span = slice(first[tier], first[tier] + count)
        _to_planes(gaps[span], gap_widths[tier], out[start : start + gap_widths[tier] * count])
        start += gap_widths[tier] * count
        _to_planes(values[span], change.itemsize, out[start : start + change.itemsize * count])


@_kernel
def change_planes(old: Any, new: Any, coding: Any, out: Any) -> Any:
    """Every element's change as planes in ``out``; returns how many changed (one dense tier)."""
    values = np.empty_like(old)
    changed = 0
    for index in range(len(old)):
        before = np.uint64(old[index])
        after = np.uint64(new[index])
        changed += before != after
        values[index] = _change(before, after, coding)
    _to_planes(values, old.itemsize, out)
    return changed


@_kernel
def _members(old: Any, low: Any, high: Any, shift: Any, exponent_mask: Any, positions: Any) -> Any:
    """The positions of the elements whose exponent lies in [low, high), in order, into ``positions``
    (one longer than ``old``); returns how many. Branch-free: every position is written, and kept by
    counting it only if it is a member."""
    span = high - low
    found = 0
    for index in range(len(old)):
        positions[found] = index
        found += ((np.uint64(old[index]) >> shift) & exponent_mask) - low < span
    return found


@_kernel
def _unplaned(data: Any, start: Any, count: Any, width: Any, values: Any) -> Any:
    """``count`` ``width``-byte values stored as planes from ``start`` in ``data``, into ``values``
    (one vectorised pass per plane: reading each entry's bytes where it is used costs twice as much)."""
    _from_planes(data[start : start + width * count], width, values[:count])
    return values[:count]


@_kernel
def _scatter(old: Any, out: Any, positions: Any, members: Any, gaps: Any, changes: Any, coding: Any) -> Any:
    """A ranked part's ``changes`` put at the members its keys (``gaps`` + 1 summed, from 0) rank;
    ``positions`` None: the keys are positions in the chunk. Stops at the first key out of range or not
    above the one before (a sum that wrapped): returns the entries used, which the caller compares with
    their count. Each change applies to the base value."""
    key = _ZERO
    used = 0
    for index in range(len(changes)):
        following = gaps[index] if index == 0 else key + gaps[index] + _ONE
        if following >= np.uint64(members) or (index > 0 and following <= key):
            break
        key = following
        at = key if positions is None else np.uint64(positions[key])
        out[at] = _apply(np.uint64(old[at]), np.uint64(changes[index]), coding)
        used += 1
    return used


@_kernel
def apply_parts(
    old: Any,
    out: Any,
    bounds: Any,
    dense: Any,
    counts: Any,
    gap_widths: Any,
    offsets: Any,
    data: Any,
    coding: Any,
) -> Any:
    """The applier's passes: ``out`` is ``old`` with each part's changes put where its keys say.

    Part ``p``'s payload (``counts[p]`` entries: gap planes of ``gap_widths[p]`` bytes, then change
    planes) starts at ``offsets[p]`` in ``data``; the caller has checked every payload lies inside it.
    Tier ``p`` (exponents from ``bounds[p - 1]``, 0 for the first, below ``bounds[p]``) lists its
    members' positions in one branch-free pass, then its changes go to the members at the coded ranks
    (a dense tier: its first ``counts[p]`` members); the rest's go to the coded positions, applied to the
    base value after any tier (as numpy's last assignment does). A key out of range, or a sum of gaps
    that wrapped, ends its part there. Returns per part the members met (0 for the rest) and the entries
    used (0 for a dense tier): the caller refuses the chunk unless a dense tier met exactly its count and
    every other part used all its entries.
    """
    shift, exponent_mask = coding[0], coding[1]
    parts = len(counts)
    rest = parts - 1
    out[:] = old
    members = np.zeros(parts, np.int64)
    used = np.zeros(parts, np.int64)
    positions = np.empty(len(old) + 1, np.uint32)  # a chunk is at most 64 MiB: 2^26 elements
    largest = counts.max()
    gaps = np.empty(largest, np.uint64)
    changes = np.empty(largest, old.dtype)
    low = _ZERO
    for tier in range(parts):
        count, start, gap_width = counts[tier], offsets[tier], gap_widths[tier]
        high = np.uint64(bounds[tier]) if tier < rest else low
        if tier < rest and (count or dense[tier]):
            members[tier] = _members(old, low, high, shift, exponent_mask, positions)
        low = high
        if not count:
            continue
        gap = _unplaned(data, start, count, gap_width, gaps)
        change = _unplaned(data, start + gap_width * count, count, old.itemsize, changes)
        if tier == rest:
            used[tier] = _scatter(old, out, None, len(old), gap, change, coding)
        elif not dense[tier]:
            used[tier] = _scatter(old, out, positions, members[tier], gap, change, coding)
        else:
            for rank in range(min(members[tier], count)):
                at = positions[rank]
                out[at] = _apply(np.uint64(old[at]), np.uint64(change[rank]), coding)
    return members, used
