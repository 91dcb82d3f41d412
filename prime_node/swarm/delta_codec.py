"""A new checkpoint as a compact delta against an older one, and its byte-identical reconstruction.

Consecutive RL policies differ in few values, so a version is shipped as the changed values only
(docs/deltas.md). This module walks the files of a model directory; the format and its limits are
``delta_format``, the chunk coding ``delta_encode`` and ``delta_apply``, the element orders ``delta_order``.

The delta is read from the network: every length in it is checked before anything is allocated, zstd frames
must declare exactly the size the structure implies, safetensors headers are parsed by our own bounded
parser, paths are checked like manifest paths, and the output (one file at a time, one chunk of one tensor
at a time) is bounded by ``max_output_bytes``. The delta carries BLAKE3 digests of every target file and of
itself, so a corrupted delta or a wrong base is refused here, before the caller's piece hashes.
"""

from __future__ import annotations

import logging
import shutil
import struct
import time
from pathlib import Path

from blake3 import blake3

from prime_node.atomic_files import node_error_from_os, temporary_sibling
from prime_node.errors import NodeError
from prime_node.swarm import delta_select
from prime_node.swarm.checkpoint_pieces import list_model_files
from prime_node.swarm.delta_apply import Reader, apply_file
from prime_node.swarm.delta_encode import Writer, encode_tensors
from prime_node.swarm.delta_format import (
    CHUNK_DENSE,
    CHUNK_RAW,
    CHUNK_SPARSE,
    CHUNK_TIERED,
    CHUNK_UNCHANGED,
    COPY_BLOCK,
    DEFAULT_CHUNK_BYTES,
    DELTA_FILE_NAME,
    FILE_RAW,
    FILE_SAME,
    FILE_TENSORS,
    MAGIC,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    READABLE_VERSIONS,
    VERSION,
    DeltaError,
    DeltaStats,
    read_layout,
)
from prime_node.swarm.delta_pool import Ordered, workers
from protocol.errors import InvariantError
from protocol.manifest import MAX_FILES, check_relative_path

__all__ = [
    "CHUNK_DENSE",
    "CHUNK_RAW",
    "CHUNK_SPARSE",
    "CHUNK_TIERED",
    "CHUNK_UNCHANGED",
    "DEFAULT_CHUNK_BYTES",
    "DELTA_FILE_NAME",
    "FILE_RAW",
    "FILE_SAME",
    "FILE_TENSORS",
    "MAGIC",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "VERSION",
    "DeltaError",
    "DeltaStats",
    "apply_delta",
    "encode_delta",
]

log = logging.getLogger(__name__)


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


def _encode_files(
    writer: Writer, pool: Ordered, base_dir: Path, target_dir: Path, chunk_bytes: int
) -> tuple[int, int, list[tuple[str, int]]]:
    """Write every file's entry; returns (changed, total) tensor elements and the files."""
    files = list_model_files(target_dir)
    writer.put(MAGIC + struct.pack("<HII", VERSION, chunk_bytes, len(files)))
    changed = total = 0
    for relative, size in files:
        target_file, base_file = target_dir / relative, base_dir / relative
        name = relative.encode()
        writer.put(struct.pack("<H", len(name)) + name + struct.pack("<Q", size))
        found = read_layout(target_file) if relative.endswith(".safetensors") else None
        delta_select.load_for(size)
        if _same_file(base_file, target_file, size):
            writer.put(bytes([FILE_SAME]))
            digest = _file_digest(target_file)
        elif found is not None:
            writer.put(bytes([FILE_TENSORS]))
            counted = encode_tensors(writer, pool, base_file, target_file, found, chunk_bytes)
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
    return changed, total, files


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
    chunks coded at once (default: one per core, at most 8); the output does not depend on it.
    """
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes & (chunk_bytes - 1):
        raise ValueError(f"chunk_bytes {chunk_bytes} is not a power of two in [64 KiB, 64 MiB]")
    count = workers(threads)
    began = time.perf_counter()
    partial_file = temporary_sibling(out_file)
    try:
        with partial_file.open("wb") as handle, Ordered(count) as pool:
            changed, total, files = _encode_files(
                Writer(handle, level), pool, base_dir, target_dir, chunk_bytes
            )
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


def _apply(base_dir: Path, delta_file: Path, out_dir: Path, max_output_bytes: int, count: int) -> None:
    with delta_file.open("rb") as handle, Ordered(count) as pool:
        reader = Reader(handle)
        if reader.take(len(MAGIC)) != MAGIC:
            raise DeltaError(f"{delta_file.name} is not a delta file")
        version, chunk_bytes, files = reader.u16(), reader.u32(), reader.u32()
        if version not in READABLE_VERSIONS:
            raise DeltaError(f"delta format version {version} is not supported")
        reader.version = version
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes & (chunk_bytes - 1):
            raise DeltaError(f"a delta chunk size of {chunk_bytes} bytes")
        if not 1 <= files <= MAX_FILES:
            raise DeltaError(f"a delta of {files} files")
        paths = _Paths()
        written = 0
        for _ in range(files):
            path = paths.admit(reader.take(reader.u16()))
            size = reader.u64()
            written += size
            if written > max_output_bytes:
                raise DeltaError(f"the delta's files exceed the {max_output_bytes}-byte bound")
            delta_select.load_for(size)
            apply_file(reader, pool, base_dir, out_dir, path, size, chunk_bytes)
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
    whatever the checkpoint's size. Reads format versions 1 and 2. Raises DeltaError (``bad_delta``) for a
    hostile or mismatched delta, NodeError for local I/O failures. Does not fsync: the caller verifies the
    result against the target's manifest and makes it durable.
    """
    try:
        out_dir.mkdir()
    except FileExistsError as exc:
        raise NodeError(f"{out_dir} already exists", reason="output_exists") from exc
    except OSError as exc:
        raise node_error_from_os(exc, f"creating {out_dir}") from exc
    count = workers(threads)
    try:
        _apply(base_dir, delta_file, out_dir, max_output_bytes, count)
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
