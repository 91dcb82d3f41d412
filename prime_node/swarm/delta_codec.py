"""A new checkpoint as a compact delta against an older one, and its byte-identical reconstruction.

Consecutive RL policies differ in few values, so a version is shipped as the changed values only
(docs/deltas.md). The delta is read from the network: every length in it is checked before anything is
allocated, zstd frames must declare exactly the size the structure implies, safetensors headers are parsed by
our own bounded parser, paths are checked like manifest paths, and the output (one file at a time, one chunk
of one tensor at a time) is bounded by ``max_output_bytes``. The delta carries BLAKE3 digests of every target
file and of itself, so a corrupted delta or a wrong base is refused here, before the caller's piece hashes.

Format, version 1 (integers little-endian; ``z(...)`` is ``u32 length`` + one zstd frame with its content
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
    trailer  digest[32]  (BLAKE3 of every byte before it)

A base tensor is usable when the base file of the same path has a tensor of that name, dtype and byte size.
The elements of a float chunk are visited in the order of the base values' exponents (stable sort),
integers in file order; gaps count the unchanged elements before each changed one in that order. A change
is the zigzag-coded difference, modulo 2**bits, of the element's bits as unsigned integers, floats first
mapped to integers in the order of their values: a value moved by one representable step is a change of
1 or 2 whatever its sign (the other bytes zero), which zstd codes in a few bits.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np
import zstandard
from blake3 import blake3

from prime_node.atomic_files import node_error_from_os, temporary_sibling
from prime_node.bounded_json import loads_bounded
from prime_node.errors import NodeError
from prime_node.swarm.checkpoint import list_model_files
from protocol.errors import InvariantError
from protocol.manifest import MAX_FILES, check_relative_path

log = logging.getLogger(__name__)

DELTA_FILE_NAME = "weights.delta"
MAGIC = b"PNDELTA\x00"
VERSION = 1
DEFAULT_CHUNK_BYTES = 4 << 20
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 64 << 20
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own cap
MAX_TENSORS = 1 << 18
DIGEST = 32
COPY_BLOCK = 1 << 20
MAX_THREADS = 8
DENSE_TRIAL_SHARE = 4
"""The encoder tries a dense record only when at least 1/4 of a chunk's elements changed."""
_T = TypeVar("_T")

FILE_SAME, FILE_RAW, FILE_TENSORS = 0, 1, 2
CHUNK_UNCHANGED, CHUNK_SPARSE, CHUNK_DENSE, CHUNK_RAW = 0, 1, 2, 3
GAP_WIDTHS = (1, 2, 4, 8)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ELEMENT_SIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_MANTISSA_BITS = {"F8_E5M2": 2, "F8_E4M3": 3, "F16": 10, "BF16": 7, "F32": 23, "F64": 52}
_FLOATS = frozenset(_MANTISSA_BITS)


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
class _Tensor:
    name: str
    dtype: str
    begin: int  # within the data region
    end: int
    element_size: int

    @property
    def floating(self) -> bool:
        """Sign-magnitude floats: their changes are coded in value order."""
        return self.dtype in _FLOATS and self.element_size == _ELEMENT_SIZE[self.dtype]


@dataclass(frozen=True)
class _Layout:
    """A safetensors file's header and its tensors in data order, checked to tile the data region."""

    header_len: int
    tensors: tuple[_Tensor, ...]

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    def by_name(self) -> dict[str, _Tensor]:
        return {tensor.name: tensor for tensor in self.tensors}


def _parse_layout(header: bytes, file_size: int) -> _Layout:
    """The tensors of a safetensors file of ``file_size`` bytes whose JSON header is ``header``.

    Raises ValueError for anything but a header whose tensors exactly tile the rest of the file.
    """
    if 8 + len(header) > file_size:
        raise ValueError("header longer than the file")
    parsed = loads_bounded(header, max_depth=4)
    if not isinstance(parsed, dict) or len(parsed) > MAX_TENSORS:
        raise ValueError("header is not a JSON object of at most MAX_TENSORS entries")
    tensors: list[_Tensor] = []
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
        size = _ELEMENT_SIZE.get(dtype, 1)
        tensors.append(_Tensor(name, dtype, begin, end, size if (end - begin) % size == 0 else 1))
    tensors.sort(key=lambda t: (t.begin, t.end, t.name))
    position = 0
    for tensor in tensors:
        if tensor.begin != position:
            raise ValueError("tensor data has a gap or an overlap")
        position = tensor.end
    if 8 + len(header) + position != file_size:
        raise ValueError("tensor data does not end at the end of the file")
    return _Layout(len(header), tuple(tensors))


def _read_layout(path: Path) -> tuple[_Layout, bytes] | None:
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
        return _parse_layout(header, size), header
    except ValueError:
        return None


def _chunks(tensor: _Tensor, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(start, length) of each chunk of ``tensor``'s data, relative to the data region."""
    for start in range(tensor.begin, tensor.end, chunk_bytes):
        yield start, min(chunk_bytes, tensor.end - start)


def _planes(data: bytes | np.ndarray, width: int) -> bytes:
    """Byte ``k`` of every element together, for each ``k``: the high bytes of small numbers are zeros."""
    array = np.frombuffer(data, dtype=np.uint8)
    return array.reshape(-1, width).T.tobytes() if width > 1 else array.tobytes()


def _unplanes(data: bytes, width: int) -> np.ndarray:
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


def _change(old: np.ndarray, new: np.ndarray, floating: bool) -> np.ndarray:
    """The zigzag-coded difference new - old (modulo 2**bits) in value order: small for small moves."""
    difference = (_ordered(new, floating) - _ordered(old, floating)).view(old.dtype.str.replace("u", "i"))
    bits = 8 * old.dtype.itemsize
    zigzag: np.ndarray = ((difference << 1) ^ (difference >> (bits - 1))).view(old.dtype)
    return zigzag


def _apply_change(old: np.ndarray, change: np.ndarray, floating: bool) -> np.ndarray:
    """Inverse of ``_change``: any ``change`` gives some values (checking them is the digests' job)."""
    one = change.dtype.type(1)
    difference = (change >> one) ^ (np.zeros_like(change) - (change & one))
    return _unordered(_ordered(old, floating) + difference, floating)


def _visit_order(old: np.ndarray, tensor: _Tensor) -> np.ndarray | None:
    """The order a float chunk's elements are coded in: stably sorted by the base value's exponent.

    Whether a value changes, and by how many representable steps, depends mostly on its magnitude (an
    update of a given size is many steps for a small value, often none for a large one), so grouping by
    exponent makes neighbouring gaps and changes alike: 23% fewer bytes than file order on the bf16
    benchmark (docs/deltas.md). The decoder derives the same order from the base. None: file order.

    Sorting (exponent << index bits | index) as one unsigned integer gives the same stable order as an
    argsort of the exponents, at half its cost: numpy sorts 32-bit integers with SIMD, and the indices
    come out as 32-bit integers (half the memory traffic of argsort's int64).
    """
    if not tensor.floating:
        return None
    order, _ = _visit(old, tensor, None)
    return order


def _visit(
    old: np.ndarray, tensor: _Tensor, flags: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """A float chunk's visiting order and, given ``flags`` (booleans in file order), the positions in
    visiting order of the elements flagged: the flag rides in the sort key's lowest bit, which spares
    gathering the flags by the order (the encoder's changed elements)."""
    extra = 0 if flags is None else 1
    mantissa = _MANTISSA_BITS[tensor.dtype]
    exponent_bits = 8 * tensor.element_size - mantissa - 1
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
    positions = None if flags is None else np.flatnonzero(key & wide(1))
    key &= wide((1 << index_bits) - 1)
    key >>= wide(extra)
    return key, positions


def _unvisit(values: np.ndarray, order: np.ndarray | None) -> np.ndarray:
    """Values in visiting order back in file order."""
    if order is None:
        return values
    out = np.empty_like(values)
    out[order] = values
    return out


def _compress_bound(size: int) -> int:
    """An upper bound on an honest zstd frame of ``size`` bytes (zstd's ZSTD_COMPRESSBOUND plus slack)."""
    return size + (size >> 7) + 1024


def _workers(threads: int | None) -> int:
    """Chunks coded at once: one per core (numpy's large operations, zstd and BLAKE3 release the GIL)."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


class _Ordered:
    """Jobs run in a thread pool, their results handed back in submission order on the calling thread,
    at most ``2 * workers`` pending (memory stays at a few chunks per worker). Leaving the context cancels
    the jobs not started and waits for the others."""

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="delta")
        self._pending: deque[tuple[Future[Any], Callable[[Any], None]]] = deque()
        self._depth = 2 * workers

    def __enter__(self) -> _Ordered:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, job: Callable[[], _T], done: Callable[[_T], None]) -> None:
        """Run ``job`` in the pool; ``done`` gets its result, in order, on this thread."""
        self._pending.append((self._pool.submit(job), done))
        while len(self._pending) > self._depth:
            self._next()

    def drain(self) -> None:
        """Hand back every pending result (re-raising the first job's exception, if any)."""
        while self._pending:
            self._next()

    def abandon(self) -> None:
        """Drop the pending jobs: cancel those not started and wait for the others (which may still be
        reading a file the caller is about to close)."""
        for future, _ in self._pending:
            future.cancel()
        for future, _ in self._pending:
            if not future.cancelled():
                future.exception()
        self._pending.clear()

    def _next(self) -> None:
        future, done = self._pending.popleft()
        done(future.result())


# ---------------------------------------------------------------------------------------------------- encode


class _Writer:
    """The delta file being written, hashed as it goes (the trailer)."""

    def __init__(self, handle: BinaryIO, level: int) -> None:
        self._handle = handle
        self._hash = blake3()
        self._level = level
        self._local = threading.local()

    def put(self, data: bytes) -> None:
        self._handle.write(data)
        self._hash.update(data)

    def frame(self, data: bytes) -> None:
        self.put(self.compress(data))

    def compress(self, data: bytes) -> bytes:
        """``z(data)``; safe from any thread (each has its own compressor: one is not thread-safe)."""
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = zstandard.ZstdCompressor(level=self._level, write_content_size=True)
            self._local.compressor = compressor
        compressed = compressor.compress(data)
        return struct.pack("<I", len(compressed)) + compressed

    def finish(self) -> None:
        self._handle.write(self._hash.digest())


def _encode_chunk(
    compress: Callable[[bytes], bytes], base: bytes | None, target: bytes, tensor: _Tensor
) -> tuple[bytes, int]:
    """The smallest record for one chunk and how many of its elements changed (runs in a worker).

    Only the changed elements are gathered and coded when the chunk is sparse; the dense candidate (every
    element's change) is tried only when at least a quarter of the elements changed, since below that the
    sparse record is the smaller one (docs/deltas.md).
    """
    width = tensor.element_size
    if base is None:
        return bytes([CHUNK_RAW]) + compress(_planes(target, width)), len(target) // width
    old, new = np.frombuffer(base, dtype=_UINT[width]), np.frombuffer(target, dtype=_UINT[width])
    differs = old != new
    changed = int(np.count_nonzero(differs))
    if changed == 0:
        return bytes([CHUNK_UNCHANGED]), 0
    if tensor.floating:
        order, visited = _visit(old, tensor, differs)
        assert visited is not None
        positions: np.ndarray = visited
    else:
        order, positions = None, np.flatnonzero(differs)
    candidates = []
    if changed * DENSE_TRIAL_SHARE >= len(new):
        visited_old, visited_new = (old, new) if order is None else (old[order], new[order])
        change = _change(visited_old, visited_new, tensor.floating)
        candidates.append(bytes([CHUNK_DENSE]) + compress(_planes(change, width)))
    if changed * 2 > len(new):
        candidates.append(bytes([CHUNK_RAW]) + compress(_planes(target, width)))
    gaps = np.diff(positions, prepend=-1) - 1
    gap_width = next(w for w in GAP_WIDTHS if int(gaps.max()) < 1 << (8 * w))
    if changed * (gap_width + width) <= len(target):
        where = positions if order is None else order[positions]
        sparse_change = _change(old[where], new[where], tensor.floating)
        payload = _planes(gaps.astype(_UINT[gap_width]), gap_width) + _planes(sparse_change, width)
        head = struct.pack("<BBI", CHUNK_SPARSE, gap_width, changed)
        candidates.append(head + compress(payload))
    if not candidates:  # too many changes for a sparse record, too few to have tried dense
        visited_old, visited_new = (old, new) if order is None else (old[order], new[order])
        change = _change(visited_old, visited_new, tensor.floating)
        candidates.append(bytes([CHUNK_DENSE]) + compress(_planes(change, width)))
    return min(candidates, key=len), changed


def _same_file(base: Path, target: Path, size: int) -> bool:
    if not base.is_file() or base.is_symlink() or base.stat().st_size != size:
        return False
    with base.open("rb") as old, target.open("rb") as new:
        while block := new.read(COPY_BLOCK):
            if old.read(len(block)) != block:
                return False
    return True


def _file_digest(path: Path) -> bytes:
    digest = blake3()
    with path.open("rb") as handle:
        while block := handle.read(COPY_BLOCK):
            digest.update(block)
    return digest.digest()


def _encode_tensors(
    writer: _Writer,
    pool: _Ordered,
    base_file: Path,
    target_file: Path,
    layout: _Layout,
    header: bytes,
    chunk_bytes: int,
) -> tuple[int, int, bytes]:
    """Write a safetensors file's body; returns (changed, total) elements and the file's BLAKE3.

    Chunks are read and hashed here, in file order (the tensors tile the file after its header), and
    coded in the pool; their records are written in order as they come back.
    """
    found = _read_layout(base_file) if base_file.is_file() and not base_file.is_symlink() else None
    base_tensors = found[0].by_name() if found else {}
    base_start = found[0].data_start if found else 0
    writer.put(struct.pack("<Q", len(header)))
    writer.frame(header)
    digest = blake3(struct.pack("<Q", len(header)) + header)
    counts = [0, 0]

    def done(result: tuple[bytes, int]) -> None:
        writer.put(result[0])
        counts[0] += result[1]

    with ExitStack() as stack:
        new = stack.enter_context(target_file.open("rb"))
        old = stack.enter_context(base_file.open("rb")) if found else None
        for tensor in layout.tensors:
            match = base_tensors.get(tensor.name)
            usable = (
                match is not None
                and match.dtype == tensor.dtype
                and match.end - match.begin == tensor.end - tensor.begin
            )
            counts[1] += (tensor.end - tensor.begin) // tensor.element_size
            for start, length in _chunks(tensor, chunk_bytes):
                target = os.pread(new.fileno(), length, layout.data_start + start)
                if len(target) != length:
                    raise OSError(f"{target_file} changed while it was being encoded")
                digest.update(target)
                base = None
                if usable and match is not None and old is not None:
                    offset = base_start + match.begin + (start - tensor.begin)
                    base = os.pread(old.fileno(), length, offset)
                    if len(base) != length:
                        raise OSError(f"{base_file} is shorter than its header says")
                job = partial(_encode_chunk, writer.compress, base, target, tensor)
                pool.submit(job, done)
        pool.drain()
    return counts[0], counts[1], digest.digest()


def encode_delta(
    base_dir: Path,
    target_dir: Path,
    out_file: Path,
    *,
    level: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    threads: int | None = None,
) -> DeltaStats:
    """Write the delta that turns ``base_dir`` into ``target_dir`` (every file of it) to ``out_file``.

    The file is written next to ``out_file`` and renamed into place. Raises NodeError when ``target_dir``
    is not a model directory or on I/O errors. ``chunk_bytes`` (a power of two, 64 KiB to 64 MiB) is the
    unit of the applier's memory; tests make it small to cut tensors into several chunks. ``threads``:
    chunks coded at once (default: one per core, at most ``MAX_THREADS``); the output does not depend on it.
    """
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes & (chunk_bytes - 1):
        raise ValueError(f"chunk_bytes {chunk_bytes} is not a power of two in [64 KiB, 64 MiB]")
    workers = _workers(threads)
    began = time.perf_counter()
    files = list_model_files(target_dir)
    partial_file = temporary_sibling(out_file)
    changed = total = 0
    try:
        with partial_file.open("wb") as handle, _Ordered(workers) as pool:
            writer = _Writer(handle, level)
            writer.put(MAGIC + struct.pack("<HII", VERSION, chunk_bytes, len(files)))
            for relative, size in files:
                target_file, base_file = target_dir / relative, base_dir / relative
                name = relative.encode()
                writer.put(struct.pack("<H", len(name)) + name + struct.pack("<Q", size))
                found = _read_layout(target_file) if relative.endswith(".safetensors") else None
                if _same_file(base_file, target_file, size):
                    writer.put(bytes([FILE_SAME]))
                    digest = _file_digest(target_file)
                elif found is not None:
                    writer.put(bytes([FILE_TENSORS]))
                    layout, header = found
                    counted = _encode_tensors(
                        writer, pool, base_file, target_file, layout, header, chunk_bytes
                    )
                    changed, total, digest = changed + counted[0], total + counted[1], counted[2]
                else:
                    writer.put(bytes([FILE_RAW]))
                    hashed = blake3()
                    with target_file.open("rb") as source:
                        while block := source.read(chunk_bytes):
                            hashed.update(block)
                            writer.frame(block)
                    digest = hashed.digest()
                writer.put(digest)
            writer.finish()
        partial_file.replace(out_file)
    except OSError as exc:
        partial_file.unlink(missing_ok=True)
        raise node_error_from_os(exc, "writing a delta") from exc
    except BaseException:
        partial_file.unlink(missing_ok=True)
        raise
    return DeltaStats(
        delta_bytes=out_file.stat().st_size,
        full_bytes=sum(size for _, size in files),
        changed_values=changed,
        total_values=total,
        seconds=time.perf_counter() - began,
    )


# ----------------------------------------------------------------------------------------------------- apply


class _Reader:
    """The delta being read: exact reads, each bounded before it allocates, hashed for the trailer."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._hash = blake3()
        self.zstd = _Decompressors()

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
        if length > _compress_bound(size):
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


class _Output:
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


class _Paths:
    """The target's paths: manifest rules, strictly increasing, no duplicates or file-in-file (any case)."""

    def __init__(self) -> None:
        self._last = ""
        self._files: set[str] = set()
        self._dirs: set[str] = set()

    def admit(self, raw: bytes) -> str:
        try:
            path = raw.decode("ascii")
            check_relative_path(path)
        except (UnicodeDecodeError, InvariantError) as exc:
            raise DeltaError(f"a file name in the delta is not allowed: {raw[:60]!r}") from exc
        if path <= self._last:
            raise DeltaError("file names in the delta are not in strictly increasing order")
        folded = path.lower()
        parents = folded.split("/")[:-1]
        prefixes = {"/".join(parents[: i + 1]) for i in range(len(parents))}
        if folded in self._files or folded in self._dirs or prefixes & self._files:
            raise DeltaError(f"file name {path!r} collides with another one in the delta")
        self._last = path
        self._files.add(folded)
        self._dirs |= prefixes
        return path


def _base_file(base_dir: Path, relative: str) -> Path:
    path = base_dir / relative
    if not path.is_file() or path.is_symlink():
        raise DeltaError(f"the base has no file {relative}")
    return path


class _Decompressors:
    """One zstd decompressor per thread (one is not thread-safe)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def decompress(self, compressed: bytes, size: int) -> bytes:
        """A frame ``_Reader.compressed`` admitted, which must decompress to exactly ``size`` bytes."""
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


def _read_base(handle: BinaryIO, length: int, offset: int) -> bytes:
    base = os.pread(handle.fileno(), length, offset)
    if len(base) != length:
        raise DeltaError("the base file is shorter than its header says")
    return base


def _apply_chunk(
    zstd: _Decompressors,
    kind: int,
    compressed: bytes,
    sparse: tuple[int, int],
    base: Callable[[], bytes] | None,
    length: int,
    tensor: _Tensor,
) -> bytes | np.ndarray:
    """One chunk of the target from its record (already read and bounded) and its base (runs in a worker).

    A sparse chunk touches only its changed elements: their file positions are the visiting order at
    the coded positions, so nothing else is permuted.
    """
    width = tensor.element_size
    if kind == CHUNK_RAW:
        return _unplanes(zstd.decompress(compressed, length), width)
    if base is None:
        raise DeltaError("a chunk refers to a base tensor that does not fit")
    if kind == CHUNK_UNCHANGED:
        return base()
    old = np.frombuffer(base(), dtype=_UINT[width])
    if kind == CHUNK_DENSE:
        order = _visit_order(old, tensor)
        change = _unplanes(zstd.decompress(compressed, length), width).view(_UINT[width])
        return _unvisit(_apply_change(old if order is None else old[order], change, tensor.floating), order)
    gap_width, count = sparse
    payload = zstd.decompress(compressed, count * (gap_width + width))
    split = count * gap_width
    gaps = _unplanes(payload[:split], gap_width).view(_UINT[gap_width]).astype(np.uint64)
    positions = np.cumsum(gaps + np.uint64(1), dtype=np.uint64) - np.uint64(1)
    # uint64 wrap-around makes a position no larger than the one before, so this also catches overflow
    if int(positions[-1]) >= length // width or np.any(positions[1:] <= positions[:-1]):
        raise DeltaError("a sparse chunk's positions are out of range")
    order = _visit_order(old, tensor)
    where = positions.astype(np.intp) if order is None else order[positions.astype(np.intp)]
    change = _unplanes(payload[split:], width).view(_UINT[width])
    values = old.copy()
    values[where] = _apply_change(old[where], change, tensor.floating)
    return values


def _apply_tensors(
    reader: _Reader,
    pool: _Ordered,
    out: _Output,
    base_path: Path | None,
    size: int,
    chunk_bytes: int,
) -> None:
    """Read a safetensors file's records here, in order (bounding every length before reading it), and
    rebuild its chunks in the pool; they are written and hashed here, in order."""
    header_len = reader.u64()
    if header_len > MAX_SAFETENSORS_HEADER or 8 + header_len > size:
        raise DeltaError(f"a safetensors header of {header_len} bytes")
    header = reader.frame(header_len)
    try:
        layout = _parse_layout(header, size)
    except ValueError as exc:
        raise DeltaError(f"a safetensors header in the delta is malformed: {exc}") from exc
    found = _read_layout(base_path) if base_path is not None else None
    base_tensors = found[0].by_name() if found else {}
    out.write(struct.pack("<Q", header_len) + header)
    with ExitStack() as stack:
        old = stack.enter_context(base_path.open("rb")) if found and base_path else None
        stack.callback(pool.abandon)  # on failure, before the base file closes under its readers
        for tensor in layout.tensors:
            match = base_tensors.get(tensor.name)
            width = tensor.element_size
            for start, length in _chunks(tensor, chunk_bytes):
                base = None
                if (
                    found is not None
                    and old is not None
                    and match is not None
                    and match.dtype == tensor.dtype
                    and match.end - match.begin == tensor.end - tensor.begin
                ):
                    offset = found[0].data_start + match.begin + (start - tensor.begin)
                    base = partial(_read_base, old, length, offset)
                kind, compressed, sparse = reader.u8(), b"", (0, 0)
                if kind in (CHUNK_RAW, CHUNK_DENSE):
                    compressed = reader.compressed(length)
                elif kind == CHUNK_SPARSE:
                    gap_width, count = reader.u8(), reader.u32()
                    if gap_width not in GAP_WIDTHS or count == 0 or count * (gap_width + width) > length:
                        raise DeltaError(f"a sparse chunk of {count} values with gaps of {gap_width} bytes")
                    compressed = reader.compressed(count * (gap_width + width))
                    sparse = (gap_width, count)
                elif kind != CHUNK_UNCHANGED:
                    raise DeltaError(f"unknown chunk kind {kind}")
                job = partial(_apply_chunk, reader.zstd, kind, compressed, sparse, base, length, tensor)
                pool.submit(job, out.write)
        pool.drain()


def _apply_file(
    reader: _Reader,
    pool: _Ordered,
    base_dir: Path,
    out_dir: Path,
    path: str,
    size: int,
    chunk_bytes: int,
) -> None:
    kind = reader.u8()
    target = out_dir / path
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("xb") as handle:
        out = _Output(handle, size)
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


def _apply(base_dir: Path, delta_file: Path, out_dir: Path, max_output_bytes: int, workers: int) -> None:
    with delta_file.open("rb") as handle, _Ordered(workers) as pool:
        reader = _Reader(handle)
        if reader.take(len(MAGIC)) != MAGIC:
            raise DeltaError(f"{delta_file.name} is not a delta file")
        version, chunk_bytes, count = reader.u16(), reader.u32(), reader.u32()
        if version != VERSION:
            raise DeltaError(f"delta format version {version} is not supported")
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes & (chunk_bytes - 1):
            raise DeltaError(f"a delta chunk size of {chunk_bytes} bytes")
        if not 1 <= count <= MAX_FILES:
            raise DeltaError(f"a delta of {count} files")
        paths = _Paths()
        written = 0
        for _ in range(count):
            path = paths.admit(reader.take(reader.u16()))
            size = reader.u64()
            written += size
            if written > max_output_bytes:
                raise DeltaError(f"the delta's files exceed the {max_output_bytes}-byte bound")
            _apply_file(reader, pool, base_dir, out_dir, path, size, chunk_bytes)
        reader.finish()


def apply_delta(
    base_dir: Path,
    delta_file: Path,
    out_dir: Path,
    *,
    max_output_bytes: int,
    threads: int | None = None,
) -> None:
    """Write the target directory that ``delta_file`` describes against ``base_dir`` into ``out_dir``.

    ``out_dir`` must not exist (its parent must); it is created and, on any failure, removed again.
    Memory stays at a few chunks per thread (``threads``: chunks rebuilt at once, default one per core),
    whatever the checkpoint's size. Raises DeltaError (``bad_delta``) for a
    hostile or mismatched delta, NodeError for local I/O failures. Does not fsync: the caller verifies the
    result against the target's manifest and makes it durable.
    """
    try:
        out_dir.mkdir()
    except FileExistsError as exc:
        raise NodeError(f"{out_dir} already exists", reason="output_exists") from exc
    except OSError as exc:
        raise node_error_from_os(exc, f"creating {out_dir}") from exc
    workers = _workers(threads)
    try:
        _apply(base_dir, delta_file, out_dir, max_output_bytes, workers)
    except DeltaError as exc:
        shutil.rmtree(out_dir, ignore_errors=True)
        log.warning("refused delta %s: %s", delta_file, exc)
        raise
    except OSError as exc:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise node_error_from_os(exc, f"applying {delta_file.name}") from exc
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
