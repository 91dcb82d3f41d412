"""The applier's half of the codec: a delta's records read and bounded in order, chunks rebuilt in the pool.

Everything read here is hostile. The calling thread reads every record and checks each length against the
structure before it allocates or decompresses (``Reader``); a worker then decompresses (the frame must
declare exactly the size the structure implies) and rebuilds the chunk from its base, refusing positions
out of range and tiers that do not match the base; the calling thread writes the chunks in order, bounded
by the file's declared size and hashed (``Output``).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import BinaryIO

import numpy as np
import zstandard
from blake3 import blake3

from prime_node.swarm import delta_select
from prime_node.swarm.delta_format import (
    CHUNK_DENSE,
    CHUNK_RAW,
    CHUNK_SPARSE,
    CHUNK_TIERED,
    CHUNK_UNCHANGED,
    COPY_BLOCK,
    DIGEST,
    FILE_RAW,
    FILE_SAME,
    FILE_TENSORS,
    GAP_WIDTHS,
    MAX_CHUNK_BYTES,
    MAX_SAFETENSORS_HEADER,
    MAX_TIERS,
    TIER_DENSE,
    TIER_RANKED,
    UINT,
    DeltaError,
    Tensor,
    apply_change,
    chunks,
    compress_bound,
    fits,
    parse_layout,
    positions,
    read_layout,
    unplanes,
)
from prime_node.swarm.delta_order import exponents, tier_mask, unvisit, visit_order
from prime_node.swarm.delta_pool import Ordered


class Decompressors:
    """One zstd decompressor per thread (one is not thread-safe)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def decompress(self, compressed: bytes, size: int) -> bytes:
        """A frame ``Reader.compressed`` admitted, which must decompress to exactly ``size`` bytes."""
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = zstandard.ZstdDecompressor(max_window_size=MAX_CHUNK_BYTES)
            self._local.decompressor = decompressor
        try:
            data: bytes = decompressor.decompress(compressed, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise DeltaError(f"a compressed block does not decompress: {exc}") from exc
        if len(data) != size:
            raise DeltaError("a compressed block decompresses to the wrong size")
        return data


class Reader:
    """The delta being read: exact reads, each bounded before it allocates, hashed for the trailer."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._hash = blake3()
        self.zstd = Decompressors()
        self.version = 0

    def take(self, size: int) -> bytes:
        data = self._handle.read(size)
        if len(data) != size:
            raise DeltaError("the delta ends early")
        self._hash.update(data)
        return data

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int(struct.unpack("<H", self.take(2))[0])

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def frame(self, size: int) -> bytes:
        """One zstd frame that must decompress to exactly ``size`` bytes."""
        return self.zstd.decompress(self.compressed(size), size)

    def compressed(self, size: int) -> bytes:
        """One zstd frame, still compressed, whose length is bounded for ``size`` bytes of data and which
        declares exactly that content size (python-zstandard would otherwise trust the frame's own)."""
        length = self.u32()
        if length > compress_bound(size):
            raise DeltaError(f"a compressed block of {length} bytes for {size} bytes of data")
        compressed = self.take(length)
        try:
            declared = zstandard.frame_content_size(compressed)
        except zstandard.ZstdError as exc:
            raise DeltaError(f"a compressed block does not decompress: {exc}") from exc
        if declared != size:
            raise DeltaError(f"a compressed block declares {declared} bytes, expected {size}")
        return compressed

    def finish(self) -> None:
        expected = self._hash.digest()
        if self._handle.read(DIGEST + 1) != expected:
            raise DeltaError("the delta's checksum does not match (corrupted or truncated)")


class Output:
    """One target file being written, bounded by its declared size and hashed."""

    def __init__(self, handle: BinaryIO, size: int) -> None:
        self._handle = handle
        self._left = size
        self._hash = blake3()

    def write(self, data: bytes | np.ndarray) -> None:
        view = (memoryview(data) if isinstance(data, bytes) else data.data).cast("B")
        if len(view) > self._left:
            raise DeltaError("a file's data runs past its declared size")
        self._handle.write(view)
        self._hash.update(view)
        self._left -= len(view)

    def check(self, digest: bytes) -> None:
        if self._left:
            raise DeltaError("a file's data ends before its declared size")
        if self._hash.digest() != digest:
            raise DeltaError("a reconstructed file does not match its digest (wrong base?)")


@dataclass(frozen=True)
class _Part:
    """One tier of a tiered record (``mode`` None: the rest), as read and bounded."""

    bound: int
    mode: int | None
    gap_width: int
    count: int
    compressed: bytes


@dataclass(frozen=True)
class _Record:
    kind: int
    compressed: bytes = b""
    sparse: tuple[int, int] = (0, 0)
    parts: tuple[_Part, ...] = ()


def _read_tiered(reader: Reader, tensor: Tensor, length: int) -> tuple[_Part, ...]:
    """A tiered record's tiers and frames: bounds increasing up to the dtype's exponent range, known
    modes and gap widths, and payloads that together fit in the chunk, all checked before reading."""
    count, width = reader.u8(), tensor.element_size
    if count > MAX_TIERS:
        raise DeltaError(f"a tiered chunk of {count} tiers")
    heads: list[tuple[int, int | None, int, int]] = []
    previous, top = 0, 1 << tensor.exponent_bits
    for _ in range(count):
        bound, mode, gap_width, values = reader.u16(), reader.u8(), reader.u8(), reader.u32()
        if not previous < bound <= top:
            raise DeltaError(f"a tier bound of {bound} after {previous} (at most {top})")
        dense = mode == TIER_DENSE and gap_width == 0
        if not dense and (mode != TIER_RANKED or gap_width not in GAP_WIDTHS):
            raise DeltaError(f"a tier of mode {mode} with gaps of {gap_width} bytes")
        heads.append((bound, mode, gap_width, values))
        previous = bound
    gap_width, values = reader.u8(), reader.u32()
    if gap_width not in GAP_WIDTHS:
        raise DeltaError(f"a tiered chunk's rest has gaps of {gap_width} bytes")
    heads.append((top, None, gap_width, values))
    sizes = [values * (gap_width + width) for _, _, gap_width, values in heads]
    if sum(sizes) > length:
        raise DeltaError(f"a tiered chunk of {sum(sizes)} bytes for {length} bytes of data")
    return tuple(
        _Part(bound, mode, gap_width, values, reader.compressed(size) if values else b"")
        for (bound, mode, gap_width, values), size in zip(heads, sizes, strict=True)
    )


def _apply_tiered(
    zstd: Decompressors, parts: tuple[_Part, ...], old: np.ndarray, tensor: Tensor
) -> np.ndarray:
    """A tiered chunk rebuilt: each tier's members listed from the base's exponents, the changes put
    at the coded ranks among them; the rest's changes at their positions in the chunk."""
    width, floating = tensor.element_size, tensor.floating
    values = old.copy()
    exponent: np.ndarray | None = None
    low = 0
    for part in parts:
        members = None
        if part.mode is not None:
            if part.bound < 1 << tensor.exponent_bits or low:
                exponent = exponents(old, tensor) if exponent is None else exponent
            mask = None if exponent is None else tier_mask(exponent, low, part.bound, tensor)
            members, low = (None if mask is None else np.flatnonzero(mask)), part.bound
        limit = len(old) if members is None else len(members)
        if part.mode == TIER_DENSE and part.count != limit:
            raise DeltaError(f"a dense tier of {part.count} values for {limit} in the base")
        if not part.count:
            continue
        data = zstd.decompress(part.compressed, part.count * (part.gap_width + width))
        split = part.count * part.gap_width
        where = None
        if part.mode != TIER_DENSE:
            where = positions(data[:split], part.gap_width, part.count, limit)
        if members is not None:
            where = members if where is None else members[where]
        changes = unplanes(data[split:], width).view(UINT[width])
        if where is None:
            values = apply_change(old, changes, floating)
        else:
            values[where] = apply_change(old[where], changes, floating)
    return values


def _apply_compiled(
    kernels: ModuleType, zstd: Decompressors, parts: tuple[_Part, ...], old: np.ndarray, tensor: Tensor
) -> np.ndarray:
    """``_apply_tiered`` compiled (``apply_parts``): every payload decompressed to exactly its size
    first, so each lies inside ``data`` where the kernel reads it; the kernel indexes only by keys it
    has checked against the members it listed, and what it met is checked here, part by part, as
    ``_apply_tiered`` checks it."""
    width = tensor.element_size
    bounds = np.array([part.bound for part in parts if part.mode is not None], dtype=np.uint64)
    dense = np.array([part.mode == TIER_DENSE for part in parts])
    counts = np.array([part.count for part in parts], dtype=np.int64)
    gap_widths = np.array([part.gap_width for part in parts], dtype=np.int64)
    sizes = counts * (gap_widths + width)
    frames = [
        zstd.decompress(part.compressed, int(size)) for part, size in zip(parts, sizes, strict=True) if size
    ]
    data = np.frombuffer(b"".join(frames), dtype=np.uint8)  # every payload exactly its size
    out = np.empty_like(old)
    offsets = np.cumsum(sizes) - sizes
    code = kernels.coding(tensor)
    members, used = kernels.apply_parts(old, out, bounds, dense, counts, gap_widths, offsets, data, code)
    for part, met, taken in zip(parts, members, used, strict=True):
        if part.mode == TIER_DENSE and met != part.count:
            raise DeltaError(f"a dense tier of {part.count} values for {met} in the base")
        if part.mode != TIER_DENSE and taken != part.count:
            raise DeltaError("a sparse chunk's positions are out of range")
    return out


def _apply_chunk(
    zstd: Decompressors, record: _Record, base: Callable[[], bytes] | None, length: int, tensor: Tensor
) -> bytes | np.ndarray:
    """One chunk of the target from its record (already read and bounded) and its base (runs in a worker).

    A sparse chunk touches only its changed elements: their file positions are the visiting order at
    the coded positions, so nothing else is permuted.
    """
    width, kernels = tensor.element_size, delta_select.current()
    if record.kind == CHUNK_RAW:
        raw = zstd.decompress(record.compressed, length)
        if kernels is None or width == 1:
            return unplanes(raw, width)
        values = np.empty(length // width, dtype=UINT[width])
        kernels.unplanes(np.frombuffer(raw, dtype=np.uint8), values)
        return values
    if base is None:
        raise DeltaError("a chunk refers to a base tensor that does not fit")
    if record.kind == CHUNK_UNCHANGED:
        return base()
    old = np.frombuffer(base(), dtype=UINT[width])
    if record.kind == CHUNK_TIERED and kernels is not None:
        return _apply_compiled(kernels, zstd, record.parts, old, tensor)
    if record.kind == CHUNK_TIERED:
        return _apply_tiered(zstd, record.parts, old, tensor)
    if record.kind == CHUNK_DENSE:
        order = visit_order(old, tensor)
        change = unplanes(zstd.decompress(record.compressed, length), width).view(UINT[width])
        return unvisit(apply_change(old if order is None else old[order], change, tensor.floating), order)
    gap_width, count = record.sparse
    payload = zstd.decompress(record.compressed, count * (gap_width + width))
    split = count * gap_width
    found = positions(payload[:split], gap_width, count, length // width)
    order = visit_order(old, tensor)
    where = found if order is None else order[found]
    change = unplanes(payload[split:], width).view(UINT[width])
    values = old.copy()
    values[where] = apply_change(old[where], change, tensor.floating)
    return values


def _read_record(reader: Reader, tensor: Tensor, length: int) -> _Record:
    kind, width = reader.u8(), tensor.element_size
    if kind in (CHUNK_RAW, CHUNK_DENSE):
        return _Record(kind, reader.compressed(length))
    if kind == CHUNK_SPARSE:
        gap_width, count = reader.u8(), reader.u32()
        if gap_width not in GAP_WIDTHS or count == 0 or count * (gap_width + width) > length:
            raise DeltaError(f"a sparse chunk of {count} values with gaps of {gap_width} bytes")
        return _Record(kind, reader.compressed(count * (gap_width + width)), (gap_width, count))
    if kind == CHUNK_TIERED and reader.version >= 2:
        return _Record(kind, parts=_read_tiered(reader, tensor, length))
    if kind != CHUNK_UNCHANGED:
        raise DeltaError(f"unknown chunk kind {kind}")
    return _Record(kind)


def _read_base(handle: BinaryIO, length: int, offset: int) -> bytes:
    base = os.pread(handle.fileno(), length, offset)
    if len(base) != length:
        raise DeltaError("the base file is shorter than its header says")
    return base


def _apply_tensors(
    reader: Reader, pool: Ordered, out: Output, base_path: Path | None, size: int, chunk_bytes: int
) -> None:
    """Read a safetensors file's records here, in order (bounding every length before reading it), and
    rebuild its chunks in the pool; they are written and hashed here, in order."""
    header_len = reader.u64()
    if header_len > MAX_SAFETENSORS_HEADER or 8 + header_len > size:
        raise DeltaError(f"a safetensors header of {header_len} bytes")
    header = reader.frame(header_len)
    try:
        layout = parse_layout(header, size)
    except ValueError as exc:
        raise DeltaError(f"a safetensors header in the delta is malformed: {exc}") from exc
    found = read_layout(base_path) if base_path is not None else None
    base_tensors = found[0].by_name() if found else {}
    out.write(struct.pack("<Q", header_len) + header)
    with ExitStack() as stack:
        old = stack.enter_context(base_path.open("rb")) if found and base_path else None
        stack.callback(pool.abandon)  # on failure, before the base file closes under its readers
        for tensor in layout.tensors:
            match = base_tensors.get(tensor.name)
            for start in chunks(tensor, chunk_bytes):
                length = min(chunk_bytes, tensor.end - start)
                base = None
                if found is not None and old is not None and match is not None and fits(match, tensor):
                    offset = found[0].data_start + match.begin + (start - tensor.begin)
                    base = partial(_read_base, old, length, offset)
                record = _read_record(reader, tensor, length)
                pool.submit(partial(_apply_chunk, reader.zstd, record, base, length, tensor), out.write)
        pool.drain()


def apply_file(
    reader: Reader, pool: Ordered, base_dir: Path, out_dir: Path, path: str, size: int, chunk_bytes: int
) -> None:
    """Write one target file of the delta (``path`` already checked) into ``out_dir``."""
    kind = reader.u8()
    target = out_dir / path
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("xb") as handle:
        out = Output(handle, size)
        if kind == FILE_SAME:
            with _base_file(base_dir, path).open("rb") as source:
                while block := source.read(min(COPY_BLOCK, size + 1)):
                    out.write(block)
        elif kind == FILE_RAW:
            for start in range(0, size, chunk_bytes):
                out.write(reader.frame(min(chunk_bytes, size - start)))
        elif kind == FILE_TENSORS:
            candidate = base_dir / path
            base = candidate if candidate.is_file() and not candidate.is_symlink() else None
            _apply_tensors(reader, pool, out, base, size, chunk_bytes)
        else:
            raise DeltaError(f"unknown file kind {kind}")
        out.check(reader.take(DIGEST))


def _base_file(base_dir: Path, relative: str) -> Path:
    path = base_dir / relative
    if not path.is_file() or path.is_symlink():
        raise DeltaError(f"the base has no file {relative}")
    return path
