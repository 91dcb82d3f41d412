"""The encoder's half of the codec: one chunk of a tensor as its smallest record, and a safetensors file's
chunks coded in the thread pool and written in order.

A changed chunk is a tiered record (delta_format): its elements are cut into tiers by the base value's
exponent, chosen per chunk from a sample of it (``plan``). The lowest exponents, where most values move,
form a **dense** tier (every member's change); the next spans, where a tenth and then a hundredth of the
values moved, are **ranked** tiers (each change's rank among the tier's members, as gaps, then the
changes); every other change goes to the **rest**, whose gaps count every element of the chunk. A span is
ranked only when knowing the exponent saves bytes (``_gain``): each tier costs a pass or two over the chunk
on both sides."""

from __future__ import annotations

import math
import os
import struct
import threading
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import BinaryIO

import numpy as np
import zstandard
from blake3 import blake3

from prime_node.swarm import delta_select
from prime_node.swarm.delta_format import (
    CHUNK_RAW,
    CHUNK_TIERED,
    CHUNK_UNCHANGED,
    TIER_DENSE,
    TIER_RANKED,
    UINT,
    Layout,
    Tensor,
    change,
    chunks,
    fits,
    gap_planes,
    gap_width,
    planes,
    read_layout,
)
from prime_node.swarm.delta_order import exponents, ranks_in, tier_mask, tier_table
from prime_node.swarm.delta_pool import Ordered

SAMPLE_STRIDE = 16
"""The tier plan is made from every 16th element of a chunk (of 64K or more elements)."""
SPAN_SHARES = (0.5, 0.1, 0.01)
"""Tiers are spans of exponent classes where at least these shares of the values changed (docs/deltas.md:
two or three spans code within a few percent of one tier per class, at a fraction of the passes)."""
MIN_SAMPLES = 16
"""A class seen fewer times in the sample is too small to judge: at the bottom it joins the dense tier."""
MIN_GAIN_BITS = 4096
"""A class is ranked only if that saves at least this many bits (512 bytes) of a chunk."""

Plan = list[tuple[int, int]]  # (exponent bound, tier mode) per tier
Data = bytes | memoryview
Parts = list[tuple[int, int, Data]]  # (gap width, count, payload) per tier, then the rest's


class Writer:
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

    def compress(self, data: Data) -> bytes:
        """``z(data)``; safe from any thread (each has its own compressor: one is not thread-safe)."""
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = zstandard.ZstdCompressor(level=self._level, write_content_size=True)
            self._local.compressor = compressor
        compressed = compressor.compress(data)
        return struct.pack("<I", len(compressed)) + compressed

    def finish(self) -> None:
        self._handle.write(self._hash.digest())


def _entropy(share: float) -> float:
    if share <= 0 or share >= 1:
        return 0.0
    return -(share * math.log2(share) + (1 - share) * math.log2(1 - share))


def _gain(members: float, changed: float, rest_changed: float, total: int) -> float:
    """Bits saved by ranking a class of ``members`` values, ``changed`` of them changed, instead of
    leaving its changes to the rest (``rest_changed`` changes among ``total`` values, with this class's):
    a rest gap costs about log2(total / rest_changed) + 1.5 bits, a ranked class about its members'
    binary entropy."""
    per_change = math.log2(total / max(rest_changed, 1.0)) + 1.5
    return changed * per_change - members * _entropy(changed / members)


def class_counts(
    old: np.ndarray, new: np.ndarray, stride: int, tensor: Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """Per exponent class, the sampled elements (every ``stride``-th) and those of them that changed."""
    sample = exponents(old[::stride], tensor).astype(np.intp)
    classes_total = 1 << tensor.exponent_bits
    seen = np.bincount(sample, minlength=classes_total)
    moved = np.bincount(sample[old[::stride] != new[::stride]], minlength=classes_total)
    return seen, moved


def plan(old: np.ndarray, new: np.ndarray, tensor: Tensor, kernels: ModuleType | None) -> Plan:
    """The tiers of a changed chunk, from a sample of it: the exponent classes at the bottom where at
    least half the values changed, then the next ones with at least a tenth changed, then a hundredth,
    each span a ranked tier if ranking it gains; the rest above. Every class dense: one dense tier."""
    count = len(old)
    if not tensor.floating:
        return [(1, TIER_DENSE)] if 2 * np.count_nonzero(old != new) > count else []
    stride = SAMPLE_STRIDE if count >= SAMPLE_STRIDE << 12 else 1
    classes_total = 1 << tensor.exponent_bits
    if kernels is None:
        seen, moved = class_counts(old, new, stride, tensor)
    else:
        seen, moved = kernels.class_counts(old, new, stride, kernels.coding(tensor), classes_total)
    classes = np.flatnonzero(seen).tolist()
    rest_changed = float(moved.sum()) * stride
    tiers: Plan = []
    index = 0
    for share in SPAN_SHARES:
        start = index
        while index < len(classes) and (
            moved[classes[index]] >= share * seen[classes[index]] or seen[classes[index]] < MIN_SAMPLES
        ):
            index += 1
        if index == start:
            continue
        if index == len(classes) and not tiers:
            return [(classes_total, TIER_DENSE)]
        span = classes[start:index]
        members, changed_here = float(seen[span].sum()) * stride, float(moved[span].sum()) * stride
        if _gain(members, changed_here, rest_changed, count) < MIN_GAIN_BITS:
            break
        mode = TIER_DENSE if share == SPAN_SHARES[0] else TIER_RANKED
        tiers.append((classes[index] if index < len(classes) else classes_total, mode))
        rest_changed -= changed_here
    return tiers


def _coded(old: np.ndarray, new: np.ndarray, where: np.ndarray | None, tensor: Tensor) -> bytes:
    """The change planes of the elements at ``where`` (None: every element)."""
    before, after = (old, new) if where is None else (old[where], new[where])
    return planes(change(before, after, tensor.floating), tensor.element_size)


def _parts(
    old: np.ndarray, new: np.ndarray, differs: np.ndarray, tiers: Plan, tensor: Tensor
) -> tuple[Parts, int]:
    """Each tier's and the rest's (gap width, count, payload) for ``tiers`` with numpy, and how many
    elements changed.

    The changed elements are listed once; each tier takes those of its exponents and ranks them on the
    tier's bits (``ranks_in``); a dense tier codes every member, so only it lists its members.
    """
    changed = np.flatnonzero(differs)
    everything = len(tiers) == 1 and tiers[0] == (1 << tensor.exponent_bits, TIER_DENSE)
    exponent = exponents(old, tensor) if tiers and not everything else None
    changed_exponent = np.zeros(len(changed), dtype=np.uint8) if exponent is None else exponent[changed]
    covered = np.zeros(len(changed), dtype=bool)
    parts: Parts = []
    low = 0
    for bound, mode in tiers:
        mask = None if exponent is None else tier_mask(exponent, low, bound, tensor)
        inside = changed_exponent < bound
        inside &= changed_exponent >= low
        covered |= inside
        if mode == TIER_DENSE:
            members = None if mask is None else np.flatnonzero(mask)
            count = len(old) if members is None else len(members)
            parts.append((0, count, _coded(old, new, members, tensor)))
        else:
            where = changed[inside]
            gap_width, gaps = gap_planes(where if mask is None else ranks_in(mask, where))
            parts.append((gap_width, len(where), gaps + _coded(old, new, where, tensor)))
        low = bound
    rest = changed[~covered]
    gap_width, gaps = gap_planes(rest)
    parts.append((gap_width, len(rest), gaps + _coded(old, new, rest, tensor) if len(rest) else b""))
    return parts, len(changed)


def _compiled_parts(
    kernels: ModuleType, old: np.ndarray, new: np.ndarray, tiers: Plan, tensor: Tensor
) -> tuple[Parts, int]:
    """``_parts`` in two compiled passes: every element once (``entries``: its tier, rank and change),
    then the entries into planes (``pack``)."""
    code, count, width = kernels.coding(tensor), len(old), tensor.element_size
    if tiers == [(1 << tensor.exponent_bits, TIER_DENSE)]:
        out = np.empty(count * width, dtype=np.uint8)
        changed = kernels.change_planes(old, new, code, out)
        return [(0, count, out.data), (1, 0, b"")], int(changed)
    table = tier_table([bound for bound, _ in tiers], tensor)
    dense = np.array([mode == TIER_DENSE for _, mode in tiers] + [False])
    part, key, changes = np.empty(count, np.uint8), np.empty(count, np.uint32), np.empty_like(old)
    found, changed, counts, largest = kernels.entries(old, new, table, dense, code, part, key, changes)
    widths = np.array([0 if flag else gap_width(int(gap)) for flag, gap in zip(dense, largest, strict=True)])
    sizes = counts * (widths + width)
    offsets = np.cumsum(sizes) - sizes
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    kernels.pack(found, part, key, changes, counts, widths, offsets, out)
    parts: Parts = [
        (int(gaps), int(values), out[start : start + size].data)
        for gaps, values, start, size in zip(widths, counts, offsets, sizes, strict=True)
    ]
    return parts, int(changed)


def _planes(kernels: ModuleType | None, data: bytes, width: int) -> Data:
    """``planes`` of a whole chunk (a raw record)."""
    if kernels is None or width == 1:
        return planes(data, width)
    out = np.empty(len(data), dtype=np.uint8)
    kernels.planes(np.frombuffer(data, dtype=UINT[width]), out)
    return out.data


def _tiered(compress: Callable[[Data], bytes], tiers: Plan, parts: Parts, length: int) -> bytes | None:
    """The tiered record of a chunk of ``length`` bytes from its ``parts`` (each tier's, then the
    rest's), or None if their payload would exceed the chunk."""
    if sum(len(data) for _, _, data in parts) > length:
        return None
    head = [struct.pack("<BB", CHUNK_TIERED, len(tiers))]
    head += [
        struct.pack("<HBBI", bound, mode, gaps, count)
        for (bound, mode), (gaps, count, _) in zip(tiers, parts[:-1], strict=True)
    ]
    head.append(struct.pack("<BI", *parts[-1][:2]))
    return b"".join(head) + b"".join(compress(data) for _, count, data in parts if count)


def encode_chunk(
    compress: Callable[[Data], bytes], base: bytes | None, target: bytes, tensor: Tensor
) -> tuple[bytes, int]:
    """The smallest record for one chunk and how many of its elements changed (runs in a worker):
    unchanged, tiered, or raw (tried only without a base or when more than half the values changed)."""
    width, kernels = tensor.element_size, delta_select.current()
    if base is None:
        return bytes([CHUNK_RAW]) + compress(_planes(kernels, target, width)), len(target) // width
    if base == target:
        return bytes([CHUNK_UNCHANGED]), 0
    old, new = np.frombuffer(base, dtype=UINT[width]), np.frombuffer(target, dtype=UINT[width])
    coded: Callable[[Plan], tuple[Parts, int]]
    if kernels is None:
        coded = partial(_parts, old, new, old != new, tensor=tensor)
    else:
        coded = partial(_compiled_parts, kernels, old, new, tensor=tensor)
    tiers = plan(old, new, tensor, kernels)
    parts, changed = coded(tiers)
    record = _tiered(compress, tiers, parts, len(target))
    if record is None:  # gaps and changes outgrew the chunk: every element's change is at most its size
        tiers = [(1 << tensor.exponent_bits, TIER_DENSE)]
        record = _tiered(compress, tiers, coded(tiers)[0], len(target))
        assert record is not None
    if 2 * changed > len(new):
        raw = bytes([CHUNK_RAW]) + compress(_planes(kernels, target, width))
        record = min(record, raw, key=len)
    return record, changed


def _read_base(handle: BinaryIO, length: int, offset: int, path: Path) -> bytes:
    base = os.pread(handle.fileno(), length, offset)
    if len(base) != length:
        raise OSError(f"{path} is shorter than its header says")
    return base


def _encode_read(
    compress: Callable[[Data], bytes], base: Callable[[], bytes] | None, target: bytes, tensor: Tensor
) -> tuple[bytes, int]:
    """``encode_chunk`` with the base chunk read here, in the worker (the calling thread reads and
    hashes the target in order)."""
    return encode_chunk(compress, None if base is None else base(), target, tensor)


def encode_tensors(
    writer: Writer,
    pool: Ordered,
    base_file: Path,
    target_file: Path,
    found: tuple[Layout, bytes],
    chunk_bytes: int,
) -> tuple[int, int, bytes]:
    """Write a safetensors file's body; returns (changed, total) elements and the file's BLAKE3.

    Target chunks are read and hashed here, in file order (the tensors tile the file after its header),
    and coded in the pool, which reads the base chunks; their records are written in order as they come
    back.
    """
    layout, header = found
    based = read_layout(base_file) if base_file.is_file() and not base_file.is_symlink() else None
    base_tensors = based[0].by_name() if based else {}
    base_start = based[0].data_start if based else 0
    writer.put(struct.pack("<Q", len(header)))
    writer.frame(header)
    digest = blake3(struct.pack("<Q", len(header)) + header)
    counts = [0, 0]

    def done(result: tuple[bytes, int]) -> None:
        writer.put(result[0])
        counts[0] += result[1]

    with ExitStack() as stack:
        new = stack.enter_context(target_file.open("rb"))
        old = stack.enter_context(base_file.open("rb")) if based else None
        stack.callback(pool.abandon)  # on failure, before the files close under the workers
        for tensor in layout.tensors:
            match = base_tensors.get(tensor.name)
            usable = old is not None and match is not None and fits(match, tensor)
            counts[1] += (tensor.end - tensor.begin) // tensor.element_size
            for start in chunks(tensor, chunk_bytes):
                length = min(chunk_bytes, tensor.end - start)
                target = os.pread(new.fileno(), length, layout.data_start + start)
                if len(target) != length:
                    raise OSError(f"{target_file} changed while it was being encoded")
                digest.update(target)
                base = None
                if usable and match is not None and old is not None:
                    offset = base_start + match.begin + (start - tensor.begin)
                    base = partial(_read_base, old, length, offset, base_file)
                pool.submit(partial(_encode_read, writer.compress, base, target, tensor), done)
        pool.drain()
    return counts[0], counts[1], digest.digest()
