"""A Hugging Face-format model directory as one byte stream of fixed-size pieces, and its signed manifest.

The trainer shares a directory as it is on disk (config.json, tokenizer files, *.safetensors); the files
are taken in path order, concatenated, cut into pieces and hashed in one streaming pass, so memory stays at
one piece whatever the checkpoint's size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from blake3 import blake3

from crypto.keys import WalletKey
from prime_node.atomic_files import node_error_from_os
from prime_node.errors import NodeError
from protocol.envelope import Envelope
from protocol.errors import InvariantError
from protocol.manifest import (
    MAX_FILES,
    MAX_PIECE_SIZE,
    MAX_PIECES,
    MIN_PIECE_SIZE,
    Manifest,
    build_manifest,
    check_relative_path,
    sign_manifest,
)

DEFAULT_PIECE_SIZE = 4 << 20
# A piece is re-served only once it is whole, so each hop of a broadcast costs about (pieces in flight) x
# piece size / upload rate: with too few pieces that latency is a large share of the broadcast time.
# benchmarks/broadcast.py, 256 MB over 16 shaped peers: 62 x 4 MiB pieces gave 1.37-1.44 x T*, 245 x 1 MiB
# gave 1.13 x T*. So smaller checkpoints get smaller pieces, down to a floor where per-piece costs (a
# request, a MAC'd frame, a hash) stay small. Not more than that: each piece also costs a `have` to every
# neighbour, and on 2 shared cores (issue 15, 20 MB/s links) 489 x 512 KiB pieces gave 1.64 x T* and
# 10.4 CPU-s/GB where 245 x 1 MiB gave 1.48 and 9.1. 240, not 256, so that 256 MB (10^6) gets 1 MiB.
MIN_PIECES_WANTED = 240
SMALLEST_DEFAULT_PIECE_SIZE = 256 << 10
REQUIRED_FILE = "config.json"


@dataclass(frozen=True)
class SharedCheckpoint:
    """What ``share`` produces: the manifest, its signed envelope, and the directory it describes."""

    manifest: Manifest
    envelope: Envelope
    directory: Path

    @property
    def manifest_id(self) -> bytes:
        return self.manifest.id()


def list_model_files(directory: Path) -> list[tuple[str, int]]:
    """(relative path, size) of every regular file under ``directory``, checked and in path order."""
    if not directory.is_dir():
        raise NodeError(f"{directory} is not a directory", reason="not_a_model_dir")
    files: list[tuple[str, int]] = []
    try:
        for path in sorted(directory.rglob("*")):
            if path.is_dir():
                continue
            relative = path.relative_to(directory).as_posix()
            if not path.is_file():
                raise NodeError(f"{relative} in {directory} is not a regular file", reason="bad_model_file")
            try:
                check_relative_path(relative)
            except InvariantError as exc:
                raise NodeError(f"cannot share {relative}: {exc}", reason="bad_model_file") from exc
            files.append((relative, path.stat().st_size))
    except OSError as exc:
        raise node_error_from_os(exc, f"reading {directory}") from exc
    names = {name for name, _ in files}
    if REQUIRED_FILE not in names or not any(name.endswith(".safetensors") for name in names):
        raise NodeError(
            f"{directory} is not a Hugging Face model directory (needs {REQUIRED_FILE} and *.safetensors)",
            reason="not_a_model_dir",
        )
    if len(files) > MAX_FILES:
        raise NodeError(f"{directory} has {len(files)} files, more than {MAX_FILES}", reason="too_many_files")
    return sorted(files)


def iter_pieces(directory: Path, files: list[tuple[str, int]], piece_size: int) -> Iterator[bytes]:
    """The concatenated files in ``piece_size`` chunks (the last one shorter)."""
    buffer = bytearray()
    try:
        for name, size in files:
            with open(directory / name, "rb") as handle:
                left = size
                while left:
                    chunk = handle.read(min(piece_size - len(buffer), left))
                    if not chunk:
                        raise NodeError(f"{name} shrank while it was being read", reason="file_changed")
                    buffer += chunk
                    left -= len(chunk)
                    if len(buffer) == piece_size:
                        yield bytes(buffer)
                        buffer.clear()
    except OSError as exc:
        raise node_error_from_os(exc, f"reading {directory}") from exc
    if buffer:
        yield bytes(buffer)


def choose_piece_size(total_size: int, requested: int | None = None) -> int:
    """``requested`` if given (a power of two in range); else 4 MiB, halved (to 256 KiB at least) while
    that gives fewer than 256 pieces, doubled while it gives more than the manifest allows."""
    if requested is not None:
        if requested & (requested - 1) or not MIN_PIECE_SIZE <= requested <= MAX_PIECE_SIZE:
            raise NodeError(
                f"piece size must be a power of two from {MIN_PIECE_SIZE} to {MAX_PIECE_SIZE}",
                reason="bad_piece_size",
            )
        if -(-total_size // requested) > MAX_PIECES:
            raise NodeError(
                f"piece size {requested} gives more than {MAX_PIECES} pieces", reason="bad_piece_size"
            )
        return requested
    size = DEFAULT_PIECE_SIZE
    while size > SMALLEST_DEFAULT_PIECE_SIZE and -(-total_size // size) < MIN_PIECES_WANTED:
        size //= 2
    while -(-total_size // size) > MAX_PIECES and size < MAX_PIECE_SIZE:
        size *= 2
    return size


def build_checkpoint(
    directory: Path, key: WalletKey, *, run: str, step: int, now_ms: int, piece_size: int | None = None
) -> SharedCheckpoint:
    """Hash ``directory`` and sign its manifest with ``key`` (the run's trainer key)."""
    files = list_model_files(directory)
    total = sum(size for _, size in files)
    if total == 0:
        raise NodeError(f"{directory} holds no bytes", reason="not_a_model_dir")
    size = choose_piece_size(total, piece_size)
    hashes = b"".join(blake3(piece).digest() for piece in iter_pieces(directory, files, size))
    try:
        manifest = build_manifest(
            run=run, step=step, piece_size=size, files=files, piece_hashes=hashes, signer=key.address
        )
    except InvariantError as exc:
        raise NodeError(f"cannot describe {directory}: {exc}", reason="bad_manifest") from exc
    return SharedCheckpoint(manifest, sign_manifest(key, manifest, now_ms=now_ms), directory)


def read_piece_from_files(directory: Path, manifest: Manifest, index: int) -> bytes:
    """Piece ``index`` read from the original files (how the origin serves without copying them): one
    ``pread`` per file it spans, joined only when it spans several."""
    start, end = manifest.piece_span(index)
    parts: list[bytes] = []
    try:
        for entry in manifest.files:
            low, high = max(start, entry.offset), min(end, entry.offset + entry.size)
            if low >= high:
                continue
            descriptor = os.open(directory / entry.path, os.O_RDONLY)
            try:
                part = os.pread(descriptor, high - low, low - entry.offset)
            finally:
                os.close(descriptor)
            parts.append(part)  # short if the file shrank: the piece then fails its hash at the receiver
    except OSError as exc:
        raise node_error_from_os(exc, f"reading {directory}") from exc
    return parts[0] if len(parts) == 1 else b"".join(parts)
