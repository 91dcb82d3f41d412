"""Sets of piece indices as Python ints (bit i = piece i): set algebra on thousands of pieces costs one
big-int operation, which keeps the picker fast enough to drive 10,000 simulated peers."""

from __future__ import annotations

import random

from protocol.errors import RemoteProtocolError


def full_set(count: int) -> int:
    return (1 << count) - 1


def members(bits: int) -> list[int]:
    """The indices in ``bits``, ascending."""
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return out


def from_indices(indices: list[int] | set[int] | range) -> int:
    bits = 0
    for index in indices:
        bits |= 1 << index
    return bits


def nth_member(bits: int, n: int) -> int:
    """The index of the ``n``-th (0-based) set bit, by binary search on prefix popcounts."""
    low, high = 0, bits.bit_length() - 1
    while low < high:
        middle = (low + high) // 2
        if (bits & ((2 << middle) - 1)).bit_count() > n:
            high = middle
        else:
            low = middle + 1
    return low


def random_member(bits: int, rng: random.Random) -> int:
    """A uniformly random index of a non-empty set."""
    return nth_member(bits, rng.randrange(bits.bit_count()))


def to_wire(bits: int, count: int) -> bytes:
    """Piece i is bit (i mod 8), least significant first, of byte i // 8."""
    return bits.to_bytes((count + 7) // 8, "little")


def from_wire(data: bytes, count: int) -> int:
    """Parse a bitfield for ``count`` pieces; the length and the spare high bits are checked."""
    if len(data) != (count + 7) // 8:
        raise RemoteProtocolError(f"bitfield of {len(data)} bytes for {count} pieces", reason="bad_bitfield")
    bits = int.from_bytes(data, "little")
    if bits >> count:
        raise RemoteProtocolError("bitfield sets bits beyond the last piece", reason="bad_bitfield")
    return bits
