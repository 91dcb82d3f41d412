"""The delta file format's constants, limits and element coding, shared by the encoder and the applier.

Format, version 2 (integers little-endian; ``z(...)`` is ``u32 length`` + one zstd frame with its content
size; "planes" means the bytes of each element position stored together, which zstd compresses far better):

    header   "PNDELTA\\0" u16 version u32 chunk_bytes u32 file_count
    file     u16 path_len path u64 size u8 kind body digest[32]  (BLAKE3 of the target file)
               kind same:    the base file of the same path, unchanged
               kind raw:     z(chunk) for each chunk_bytes of the file
               kind tensors: u64 header_len z(safetensors header), then per tensor in data order,
                             per chunk_bytes of its data: u8 chunk kind and
                               unchanged: (copied from the base tensor of that name)
                               sparse:    u8 gap_width u32 count z(gap planes ‖ changed-value planes)
                               dense:     z(change planes, one per element)
                               raw:       z(value planes)
                               tiered:    u8 tiers, per tier u16 bound u8 mode u8 gap_width u32 count,
                                          u8 gap_width u32 count (the rest), then z(...) for each tier
                                          and the rest in that order, those of count 0 left out:
                                            dense tier:  change planes of every member
                                            ranked tier: gap planes (counted among its members) ‖
                                                         change planes
                                            rest:        gap planes (counted among all) ‖ change planes
    trailer  digest[32]  (BLAKE3 of every byte before it)

Tier ``j`` holds the elements whose base value's exponent field is at least the bound before it (0 for
the first) and below its own (bounds increasing, at most 2**exponent_bits; anything but a float has the one
exponent 0); members in file order. The rest holds every other change, at its position in the chunk.
Version 1 is version 2 without the tiered kind; the applier reads both, the encoder writes only unchanged,
raw and tiered chunks (sparse and dense visit every element in a sorted order: docs/deltas.md).

A change is the zigzag-coded difference, modulo 2**bits, of the element's bits as unsigned integers, floats
first mapped to integers in the order of their values: a value moved by one representable step is a change
of 1 or 2 whatever its sign (the other bytes zero), which zstd codes in a few bits. Which elements a record
codes, and in what order, is ``delta_order``'s part.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from prime_node.bounded_json import loads_bounded
from prime_node.errors import NodeError

DELTA_FILE_NAME: Final = "weights.delta"
MAGIC: Final = b"PNDELTA\x00"
VERSION: Final = 2
READABLE_VERSIONS: Final = frozenset({1, 2})
DEFAULT_CHUNK_BYTES: Final = 4 << 20
MIN_CHUNK_BYTES: Final = 64 << 10
MAX_CHUNK_BYTES: Final = 64 << 20
MAX_SAFETENSORS_HEADER: Final = 100 << 20  # the safetensors library's own cap
MAX_TENSORS: Final = 1 << 18
MAX_TIERS: Final = 8
DIGEST: Final = 32
COPY_BLOCK: Final = 1 << 20

FILE_SAME, FILE_RAW, FILE_TENSORS = 0, 1, 2
CHUNK_UNCHANGED, CHUNK_SPARSE, CHUNK_DENSE, CHUNK_RAW, CHUNK_TIERED = 0, 1, 2, 3, 4
TIER_DENSE, TIER_RANKED = 0, 1
GAP_WIDTHS: Final = (1, 2, 4, 8)
UINT: Final = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
ELEMENT_SIZE: Final = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
MANTISSA_BITS: Final = {"F8_E5M2": 2, "F8_E4M3": 3, "F16": 10, "BF16": 7, "F32": 23, "F64": 52}


class DeltaError(NodeError):
    """A delta that is malformed, does not fit its base, or does not reproduce its target."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="bad_delta")


@dataclass(frozen=True)
class DeltaStats:
    """What one encode produced: sizes in bytes, tensor elements that differ from the base, wall time."""

    delta_bytes: int
    full_bytes: int
    changed_values: int
    total_values: int
    seconds: float


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    begin: int  # within the data region
    end: int
    element_size: int

    @property
    def floating(self) -> bool:
        """Sign-magnitude floats: their changes are coded in value order, grouped by exponent."""
        return self.dtype in MANTISSA_BITS and self.element_size == ELEMENT_SIZE[self.dtype]

    @property
    def mantissa_bits(self) -> int:
        return MANTISSA_BITS[self.dtype] if self.floating else 0

    @property
    def exponent_bits(self) -> int:
        """Width of the exponent field; 0 for anything but a float (every element has exponent 0)."""
        return 8 * self.element_size - self.mantissa_bits - 1 if self.floating else 0


@dataclass(frozen=True)
class Layout:
    """A safetensors file's header and its tensors in data order, checked to tile the data region."""

    header_len: int
    tensors: tuple[Tensor, ...]

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    def by_name(self) -> dict[str, Tensor]:
        return {tensor.name: tensor for tensor in self.tensors}


def parse_layout(header: bytes, file_size: int) -> Layout:
    """The tensors of a safetensors file of ``file_size`` bytes whose JSON header is ``header``.

    Raises ValueError for anything but a header whose tensors exactly tile the rest of the file.
    """
    if 8 + len(header) > file_size:
        raise ValueError("header longer than the file")
    parsed = loads_bounded(header, max_depth=4)
    if not isinstance(parsed, dict) or len(parsed) > MAX_TENSORS:
        raise ValueError("header is not a JSON object of at most MAX_TENSORS entries")
    tensors: list[Tensor] = []
    for name, info in parsed.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ValueError(f"tensor {name[:60]!r} is not an object")
        dtype, offsets = info.get("dtype"), info.get("data_offsets")
        if not isinstance(dtype, str) or not isinstance(offsets, list) or len(offsets) != 2:
            raise ValueError(f"tensor {name[:60]!r} lacks dtype or data_offsets")
        begin, end = offsets
        if not all(type(x) is int for x in offsets) or not 0 <= begin <= end:
            raise ValueError(f"tensor {name[:60]!r} has bad data_offsets")
        size = ELEMENT_SIZE.get(dtype, 1)
        tensors.append(Tensor(name, dtype, begin, end, size if (end - begin) % size == 0 else 1))
    tensors.sort(key=lambda t: (t.begin, t.end, t.name))
    position = 0
    for tensor in tensors:
        if tensor.begin != position:
            raise ValueError("tensor data has a gap or an overlap")
        position = tensor.end
    if 8 + len(header) + position != file_size:
        raise ValueError("tensor data does not end at the end of the file")
    return Layout(len(header), tuple(tensors))


def read_layout(path: Path) -> tuple[Layout, bytes] | None:
    """The layout and header bytes of the safetensors file at ``path``, or None if it is not one."""
    try:
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) != 8:
                return None
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_SAFETENSORS_HEADER or 8 + header_len > size:
                return None
            header = handle.read(header_len)
        return parse_layout(header, size), header
    except ValueError:
        return None


def fits(base: Tensor | None, tensor: Tensor) -> bool:
    """Whether ``base`` (the base file's tensor of the same name) can be coded against."""
    return (
        base is not None and base.dtype == tensor.dtype and base.end - base.begin == tensor.end - tensor.begin
    )


def chunks(tensor: Tensor, chunk_bytes: int) -> range:
    """The start of each chunk of ``tensor``'s data, relative to the data region."""
    return range(tensor.begin, tensor.end, chunk_bytes)


def planes(data: bytes | np.ndarray, width: int) -> bytes:
    """Byte ``k`` of every element together, for each ``k``: the high bytes of small numbers are zeros."""
    array = np.frombuffer(data, dtype=np.uint8)
    return array.reshape(-1, width).T.tobytes() if width > 1 else array.tobytes()


def unplanes(data: bytes, width: int) -> np.ndarray:
    array = np.frombuffer(data, dtype=np.uint8)
    return np.ascontiguousarray(array.reshape(width, -1).T).reshape(-1) if width > 1 else array


def _ordered(bits: np.ndarray, floating: bool) -> np.ndarray:
    """Float bit patterns as unsigned integers in the order of their values (a bijection): negatives
    have every bit flipped, the rest the sign bit set."""
    if not floating:
        return bits
    ordered: np.ndarray = bits ^ _flip_mask(bits)
    return ordered


def _unordered(ordered: np.ndarray, floating: bool) -> np.ndarray:
    if not floating:
        return ordered
    bits: np.ndarray = ordered ^ _flip_mask(~ordered)
    return bits


def _flip_mask(bits: np.ndarray) -> np.ndarray:
    """All ones where ``bits`` has its top bit set, else only the top bit."""
    width = 8 * bits.dtype.itemsize
    spread = (bits.view(bits.dtype.str.replace("u", "i")) >> (width - 1)).view(bits.dtype)
    mask: np.ndarray = spread | bits.dtype.type(1 << (width - 1))
    return mask


def change(old: np.ndarray, new: np.ndarray, floating: bool) -> np.ndarray:
    """The zigzag-coded difference new - old (modulo 2**bits) in value order: small for small moves."""
    difference = (_ordered(new, floating) - _ordered(old, floating)).view(old.dtype.str.replace("u", "i"))
    bits = 8 * old.dtype.itemsize
    zigzag: np.ndarray = ((difference << 1) ^ (difference >> (bits - 1))).view(old.dtype)
    return zigzag


def apply_change(old: np.ndarray, change: np.ndarray, floating: bool) -> np.ndarray:
    """Inverse of ``change``: any ``change`` gives some values (checking them is the digests' job)."""
    one = change.dtype.type(1)
    difference = (change >> one) ^ (np.zeros_like(change) - (change & one))
    return _unordered(_ordered(old, floating) + difference, floating)


def gap_planes(positions: np.ndarray) -> tuple[int, bytes]:
    """The narrowest gap width holding the unchanged counts before each of ``positions`` (increasing),
    and the gaps' planes."""
    gaps = np.diff(positions, prepend=-1) - 1
    width = gap_width(int(gaps.max()) if len(gaps) else 0)
    return width, planes(gaps.astype(UINT[width]), width)


def gap_width(largest: int) -> int:
    """The narrowest gap width that holds ``largest``."""
    return next(w for w in GAP_WIDTHS if largest < 1 << (8 * w))


def positions(data: bytes, width: int, count: int, limit: int) -> np.ndarray:
    """The increasing positions below ``limit`` that ``count`` gaps of ``width`` bytes (planes) code."""
    gaps = unplanes(data, width).view(UINT[width]).astype(np.uint64)
    found = np.cumsum(gaps + np.uint64(1), dtype=np.uint64) - np.uint64(1)
    # uint64 wrap-around makes a position no larger than the one before, so this also catches overflow
    if count and (int(found[-1]) >= limit or np.any(found[1:] <= found[:-1])):
        raise DeltaError("a sparse chunk's positions are out of range")
    return found.astype(np.intp)


def compress_bound(size: int) -> int:
    """An upper bound on an honest zstd frame of ``size`` bytes (zstd's ZSTD_COMPRESSBOUND plus slack)."""
    return size + (size >> 7) + 1024
