"""Where a fetched checkpoint's pieces live until the download completes, and how it becomes a directory.

Layout, one directory per manifest under the store root::

    <root>/<manifest id hex>/manifest       the manifest's canonical bytes
                            pieces.bin     the byte stream, preallocated, pieces written at their offsets
                            progress       bitfield of pieces written (a hint: see below)
                            lock           held (flock) by the one process using the store

Every piece is checked against the manifest before it is written, so nothing unverified ever lands on
disk. The progress file is written whole (atomically) when the store opens, and after each piece the one
byte of it that holds the piece's bit is rewritten in place (one ``pwrite``: replacing the file per piece
cost a temp file, a rename and a directory lookup, ~10% of a receiver's CPU). It is only a hint: on open
every piece it claims is hashed again, so a process killed with SIGKILL, or a machine that lost power
before the page cache reached the disk, resumes from exactly the pieces whose bytes are really there.
While the store is open its data and progress files stay open (no open/close per piece).

``materialize`` writes the files into a temporary directory next to the target and renames it into
place, so the output directory appears whole or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

from blake3 import blake3

from prime_node.atomic_files import fsync_directory, node_error_from_os, write_atomically
from prime_node.errors import NodeError
from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.manifest import Manifest
from protocol.swarm.pieceset import from_wire, full_set, members, to_wire

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest"
DATA_FILE = "pieces.bin"
PROGRESS_FILE = "progress"
LOCK_FILE = "lock"
PARTIAL_MARK = ".partial-"
COPY_CHUNK = 8 << 20


class PieceStore:
    """The verified pieces of one manifest on disk (see the module doc)."""

    def __init__(self, directory: Path, manifest: Manifest, have: int, lock_fd: int) -> None:
        self.directory = directory
        self.manifest = manifest
        self.have = have
        self._full = full_set(manifest.piece_count)
        self._lock_fd = lock_fd
        self._data_fd = -1
        self._progress_fd = -1

    def close(self) -> None:
        """Release the store's lock and files (the kernel also releases them when the process dies)."""
        for name in ("_data_fd", "_progress_fd", "_lock_fd"):
            descriptor = getattr(self, name)
            if descriptor >= 0:
                os.close(descriptor)
                setattr(self, name, -1)

    def __enter__(self) -> PieceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def open(cls, root: Path, manifest: Manifest) -> PieceStore:
        """Open (creating or resuming) the store of ``manifest`` under ``root``."""
        directory = root / manifest.id().hex()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            lock_fd = lock_store(directory / LOCK_FILE)
        except OSError as exc:
            raise node_error_from_os(exc, f"preparing {directory}") from exc
        try:
            manifest_path = directory / MANIFEST_FILE
            if not manifest_path.exists():
                write_atomically(manifest_path, encode(manifest))
            data_path = directory / DATA_FILE
            fd = os.open(data_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size != manifest.total_size:
                    os.ftruncate(fd, 0)
                    # Reserve the space now: a full disk is reported before the download, not halfway.
                    os.posix_fallocate(fd, 0, manifest.total_size)
            finally:
                os.close(fd)
        except OSError as exc:
            os.close(lock_fd)
            if exc.errno == errno.ENOSPC:
                _truncate_quietly(directory / DATA_FILE)
            raise node_error_from_os(exc, f"preparing {directory}") from exc
        except NodeError:
            os.close(lock_fd)
            raise
        store = cls(directory, manifest, 0, lock_fd)
        try:
            store.have = store._recheck(store._load_progress())
            store._save_progress()
            store._data_fd = os.open(directory / DATA_FILE, os.O_RDWR)
            store._progress_fd = os.open(directory / PROGRESS_FILE, os.O_WRONLY)
        except OSError as exc:
            store.close()
            raise node_error_from_os(exc, f"preparing {directory}") from exc
        except NodeError:
            store.close()
            raise
        return store

    # --- progress ---------------------------------------------------------------------------------------

    def _load_progress(self) -> int:
        path = self.directory / PROGRESS_FILE
        try:
            return from_wire(path.read_bytes(), self.manifest.piece_count)
        except FileNotFoundError:
            return 0
        except (OSError, RemoteProtocolError) as exc:
            log.warning("ignoring unreadable progress file %s: %s", path, exc)
            return 0

    def _recheck(self, claimed: int) -> int:
        """Hash every claimed piece again; keep only those whose bytes match."""
        good = 0
        try:
            with open(self.directory / DATA_FILE, "rb") as handle:
                for index in members(claimed):
                    start, end = self.manifest.piece_span(index)
                    handle.seek(start)
                    if blake3(handle.read(end - start)).digest() == self.manifest.piece_hash(index):
                        good |= 1 << index
                    else:
                        log.warning(
                            "piece %d of %s failed its re-check; fetching it again", index, self.directory
                        )
        except OSError as exc:
            raise node_error_from_os(exc, f"reading {self.directory}") from exc
        return good

    def _save_progress(self) -> None:
        """Not fsynced: it changes after every piece, and ``open`` re-hashes every claimed piece."""
        progress = to_wire(self.have, self.manifest.piece_count)
        write_atomically(self.directory / PROGRESS_FILE, progress, durable=False)

    def _mark_progress(self, index: int) -> None:
        """Record piece ``index`` in the progress file: its one byte, in place (the whole file if the
        store's files are closed)."""
        if self._progress_fd < 0:
            self._save_progress()
            return
        position = index // 8
        try:
            os.pwrite(self._progress_fd, bytes([self.have >> (position * 8) & 0xFF]), position)
        except OSError as exc:
            raise node_error_from_os(exc, f"writing the progress of {self.directory}") from exc

    # --- pieces -----------------------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        return self.have == self._full

    @property
    def piece_count_held(self) -> int:
        return self.have.bit_count()

    def has(self, index: int) -> bool:
        return bool(self.have >> index & 1)

    def write(self, index: int, data: bytes) -> bool:
        """Verify and store piece ``index``. False (nothing written) if the bytes do not match the manifest.

        A failing disk raises NodeError; the piece is then not marked held, so the state stays consistent.
        """
        if not self.manifest.piece_is_valid(index, data):
            return False
        if self.has(index):
            return True
        start, _ = self.manifest.piece_span(index)
        try:
            fd = self._data_fd if self._data_fd >= 0 else os.open(self.directory / DATA_FILE, os.O_WRONLY)
            try:
                written = os.pwrite(fd, data, start)
                if written != len(data):
                    raise OSError(errno.EIO, "short write", str(self.directory / DATA_FILE))
            finally:
                if fd != self._data_fd:
                    os.close(fd)
        except OSError as exc:
            raise node_error_from_os(exc, f"writing piece {index} to {self.directory}") from exc
        self.have |= 1 << index
        try:
            self._mark_progress(index)
        except NodeError:
            self.have &= ~(1 << index)
            raise
        return True

    def read(self, index: int) -> bytes:
        """The bytes of a held piece (for serving it to other peers)."""
        if not self.has(index):
            raise NodeError(f"piece {index} is not held", reason="piece_missing")
        start, end = self.manifest.piece_span(index)
        try:
            if self._data_fd >= 0:
                data = os.pread(self._data_fd, end - start, start)
                if len(data) != end - start:
                    raise OSError(errno.EIO, "piece store is shorter than its manifest", str(self.directory))
                return data
            with open(self.directory / DATA_FILE, "rb") as handle:
                handle.seek(start)
                return handle.read(end - start)
        except OSError as exc:
            raise node_error_from_os(exc, f"reading {self.directory}") from exc

    # --- output -----------------------------------------------------------------------------------------

    def materialize(self, out: Path) -> None:
        """Write the checkpoint's files as directory ``out``, atomically (see the module doc)."""
        if not self.complete:
            missing = self.manifest.piece_count - self.piece_count_held
            raise NodeError(f"cannot write {out}: {missing} pieces are still missing", reason="incomplete")
        if out.exists():
            raise NodeError(
                f"{out} already exists; choose another --out or remove it", reason="output_exists"
            )
        parent = out.parent
        staging: Path | None = None
        try:
            parent.mkdir(parents=True, exist_ok=True)
            for stale in parent.glob(f".{out.name}{PARTIAL_MARK}*"):
                shutil.rmtree(stale, ignore_errors=True)  # left by a run killed while writing
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}{PARTIAL_MARK}", dir=parent))
            self._write_files(staging)
            os.chmod(staging, 0o755)
            os.rename(staging, out)
            staging = None
            fsync_directory(parent)
        except OSError as exc:
            raise node_error_from_os(exc, f"writing {out}") from exc
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    def _write_files(self, staging: Path) -> None:
        with open(self.directory / DATA_FILE, "rb") as source:
            for entry in self.manifest.files:
                target = staging / entry.path
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as sink:
                    source.seek(entry.offset)
                    left = entry.size
                    while left:
                        chunk = source.read(min(COPY_CHUNK, left))
                        if not chunk:
                            raise OSError(
                                errno.EIO, "piece store is shorter than its manifest", str(source.name)
                            )
                        sink.write(chunk)
                        left -= len(chunk)
                    sink.flush()
                    os.fsync(sink.fileno())
        for directory in sorted({p.parent for p in staging.rglob("*")}, reverse=True):
            fsync_directory(directory)

    def remove(self) -> None:
        for name in ("_data_fd", "_progress_fd"):
            descriptor = getattr(self, name)
            if descriptor >= 0:
                os.close(descriptor)
                setattr(self, name, -1)
        shutil.rmtree(self.directory, ignore_errors=True)


def read_stored_manifest(directory: Path) -> Manifest | None:
    """The manifest a store directory holds, or None (logged) if it is missing or unreadable."""
    try:
        return decode((directory / MANIFEST_FILE).read_bytes(), Manifest)
    except (OSError, RemoteProtocolError) as exc:
        log.warning("skipping %s: %s", directory, exc)
        return None


def lock_store(path: Path) -> int:
    """An exclusive lock on ``path``, or NodeError if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise NodeError(
            f"{path.parent} is in use by another prime-node process", reason="store_busy"
        ) from None
    return fd


def _truncate_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.truncate(path, 0)
