"""Delta versions on disk: the trainer encodes and signs one, a peer rebuilds a full version from one.

A delta version is a directory holding one file, ``weights.delta`` (prime_node/swarm/delta_codec.py), and a
manifest naming the full version it applies to (``base``) and the one it produces (``target``). A peer never
trusts the delta's output: it applies it into a temporary directory, hashes that with the target's own
trainer-signed manifest (every file, size and piece), makes it durable and only then renames it into place,
so the rebuilt directory is byte for byte the full version or nothing is left behind.

Synchronous and CPU-bound: the service calls these from ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from blake3 import blake3

from crypto.keys import WalletKey
from prime_node.atomic_files import node_error_from_os
from prime_node.errors import NodeError
from prime_node.swarm.checkpoint_pieces import SharedCheckpoint, choose_piece_size, iter_pieces
from prime_node.swarm.delta_codec import DeltaError, DeltaStats, apply_delta, encode_delta
from protocol.errors import InvariantError
from protocol.manifest import DELTA_FILE_NAME, Manifest, build_manifest, sign_manifest


@dataclass(frozen=True)
class Published:
    """What ``SwarmService.publish`` made of one step. ``reason`` says why no delta was announced
    (``delta`` when one was): ``snapshot``, ``no_base`` (none given), ``base_not_held`` (not a full
    version the service holds), ``too_large`` (over ``max_delta_share``), ``unchanged`` (the base is this
    very version), ``not_kept`` (the delta could not be stored)."""

    full: Manifest
    delta: Manifest | None
    full_bytes: int
    delta_bytes: int
    encode_seconds: float
    reason: str

    @property
    def announced(self) -> Manifest:
        """The version peers are told to take for this step."""
        return self.delta if self.delta is not None else self.full


def encode_delta_version(
    base_dir: Path,
    target_dir: Path,
    work_parent: Path,
    key: WalletKey,
    *,
    full: Manifest,
    base_id: bytes,
    now_ms: int,
    max_bytes: int,
) -> tuple[SharedCheckpoint | None, DeltaStats]:
    """Encode ``target_dir`` (described by ``full``) against ``base_dir`` (the full version ``base_id``) and
    sign the delta version, in a new directory under ``work_parent``; None if the delta exceeds
    ``max_bytes`` (nothing left behind). The caller renames the directory where it keeps versions."""
    work = Path(tempfile.mkdtemp(prefix=".delta-", dir=work_parent))
    try:
        stats = encode_delta(base_dir, target_dir, work / DELTA_FILE_NAME)
        if stats.delta_bytes > max_bytes:
            shutil.rmtree(work, ignore_errors=True)
            return None, stats
        files = [(DELTA_FILE_NAME, stats.delta_bytes)]
        piece_size = choose_piece_size(stats.delta_bytes)
        hashes = b"".join(blake3(piece).digest() for piece in iter_pieces(work, files, piece_size))
        manifest = build_manifest(
            run=full.run,
            step=full.step,
            piece_size=piece_size,
            files=files,
            piece_hashes=hashes,
            signer=key.address,
            base=base_id,
            target=full.id(),
        )
        envelope = sign_manifest(key, manifest, now_ms=now_ms)
    except InvariantError as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise NodeError(
            f"cannot describe the delta of step {full.step}: {exc}", reason="bad_manifest"
        ) from exc
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return SharedCheckpoint(manifest, envelope, work), stats


def rebuild_full(base_dir: Path, delta_file: Path, full: Manifest, out: Path) -> None:
    """Apply ``delta_file`` to ``base_dir`` and write the result to ``out`` (which must not exist) if and
    only if it is exactly the version ``full`` describes; DeltaError (``bad_delta``) otherwise, with
    nothing left at ``out`` or beside it."""
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.rebuild-", dir=out.parent))
    try:
        built = work / "out"
        apply_delta(base_dir, delta_file, built, max_output_bytes=full.total_size)
        check_against(built, full)
        _sync_tree(built)
        try:
            os.rename(built, out)
        except OSError as exc:
            raise node_error_from_os(exc, f"moving the rebuilt step {full.step} to {out}") from exc
        try:
            _sync_dir(out.parent)
        except OSError as exc:
            raise node_error_from_os(exc, f"syncing {out.parent}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_against(directory: Path, full: Manifest) -> None:
    """Raise DeltaError unless ``directory`` holds exactly ``full``'s files, sizes and piece hashes."""
    expected = [(entry.path, entry.size) for entry in full.files]
    try:
        found = sorted(
            (path.relative_to(directory).as_posix(), path.lstat().st_size)
            for path in directory.rglob("*")
            if not path.is_dir() or path.is_symlink()
        )
    except OSError as exc:
        raise node_error_from_os(exc, f"reading {directory}") from exc
    if found != expected:
        raise DeltaError(
            f"the delta rebuilt {len(found)} files ({sum(s for _, s in found)} bytes), but step {full.step} "
            f"has {len(expected)} ({full.total_size} bytes)"
        )
    count = 0
    for index, piece in enumerate(iter_pieces(directory, expected, full.piece_size)):
        if index >= full.piece_count or blake3(piece).digest() != full.piece_hash(index):
            raise DeltaError(f"the delta rebuilt piece {index} of step {full.step} wrong")
        count += 1
    if count != full.piece_count:
        raise DeltaError(f"the delta rebuilt {count} of step {full.step}'s {full.piece_count} pieces")


def _sync_tree(directory: Path) -> None:
    try:
        for path in sorted(directory.rglob("*"), reverse=True):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            else:
                _sync_dir(path)
        _sync_dir(directory)
    except OSError as exc:
        raise node_error_from_os(exc, f"syncing {directory}") from exc


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
