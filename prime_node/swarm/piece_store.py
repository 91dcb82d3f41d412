"""Where a fetched checkpoint's pieces live until the download completes, and how it becomes a directory.

Layout, one directory per manifest under the store root::

    <root>/<manifest id hex>/manifest       the manifest's canonical bytes
                            files/...      the checkpoint's own files, preallocated, each piece written
                                           into the file(s) it spans, at its offset there
                            progress       bitfield of pieces written (a hint: see below)
                            lock           held (flock) by the one process using the store

Pieces land in the checkpoint's files themselves, as a BitTorrent client writes them, so finishing a
download moves no bytes: ``materialize`` syncs the files and renames ``files`` into place, and the output
directory appears whole or not at all. (An earlier layout kept one ``pieces.bin`` and copied it out at the
end: a second copy of the checkpoint on disk, and seconds of writing after the last piece.) Only when the
output is on another file system does ``materialize`` copy, into a temporary directory beside the target
that is then renamed into place.

Every piece is checked against the manifest before it is written, so nothing unverified ever lands on
disk. The progress file is written whole (atomically) when the store opens, and after each piece the one
byte of it that holds the piece's bit is rewritten in place (one ``pwrite``: replacing the file per piece
cost a temp file, a rename and a directory lookup, ~10% of a receiver's CPU). It is only a hint: on open
every piece it claims is hashed again, so a process killed with SIGKILL, or a machine that lost power
before the page cache reached the disk, resumes from exactly the pieces whose bytes are really there.
While the store is open its progress file and the data files it touched stay open (at most
``OPEN_FILES`` of them), so there is no open/close per piece.
"""

from __future__ import annotations

import bisect
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
FILES_DIR = "files"
LEGACY_DATA_FILE = "pieces.bin"
"""The single data file of the earlier layout: a store that has one is started again from nothing."""
PROGRESS_FILE = "progress"
LOCK_FILE = "lock"
PARTIAL_MARK = ".partial-"
OPEN_FILES = 64
"""Data files a store keeps open at once: a checkpoint of many small files does not run out of descriptors."""

Segment = tuple[int, int, int, int]
"""(file index in the manifest, offset in that file, offset in the piece, length)."""


class PieceStore:
    """The verified pieces of one manifest on disk (see the module doc)."""

    def __init__(self, directory: Path, manifest: Manifest, have: int, lock_fd: int) -> None:
        self.directory = directory
        self.manifest = manifest
        self.have = have
        self._full = full_set(manifest.piece_count)
        self._lock_fd = lock_fd
        self._progress_fd = -1
        self._data_fds: dict[int, int] = {}
        self._offsets = [entry.offset for entry in manifest.files]
        self._moved_to: Path | None = None

    @property
    def files(self) -> Path:
        """The directory the checkpoint's files are written in (renamed away by ``materialize``)."""
        return self.directory / FILES_DIR

    def close(self) -> None:
        """Release the store's lock and files (the kernel also releases them when the process dies)."""
        self._close_data()
        for name in ("_progress_fd", "_lock_fd"):
            descriptor = getattr(self, name)
            if descriptor >= 0:
                os.close(descriptor)
                setattr(self, name, -1)

    def _close_data(self) -> None:
        while self._data_fds:
            os.close(self._data_fds.popitem()[1])

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
        store = cls(directory, manifest, 0, lock_fd)
        try:
            manifest_path = directory / MANIFEST_FILE
            if not manifest_path.exists():
                write_atomically(manifest_path, encode(manifest))
            legacy = directory / LEGACY_DATA_FILE
            if legacy.exists():
                log.info("%s has the earlier single-file layout: fetching its pieces again", directory)
                legacy.unlink()
                (directory / PROGRESS_FILE).unlink(missing_ok=True)
            store._prepare_files()
        except OSError as exc:
            store.close()
            if exc.errno == errno.ENOSPC:
                store._truncate_files()
            raise node_error_from_os(exc, f"preparing {directory}") from exc
        except NodeError:
            store.close()
            raise
        try:
            store.have = store._recheck(store._load_progress())
            store._save_progress()
            store._progress_fd = os.open(directory / PROGRESS_FILE, os.O_WRONLY)
        except OSError as exc:
            store.close()
            raise node_error_from_os(exc, f"preparing {directory}") from exc
        except NodeError:
            store.close()
            raise
        return store

    def _prepare_files(self) -> None:
        """Every file of the manifest at its size, space reserved: a full disk is reported before the
        download, not halfway. A file of the wrong size (a run killed while preparing) starts empty."""
        for entry in self.manifest.files:
            path = self.files / entry.path
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size != entry.size:
                    os.ftruncate(fd, 0)
                    if entry.size:
                        os.posix_fallocate(fd, 0, entry.size)
            finally:
                os.close(fd)

    def _truncate_files(self) -> None:
        """After a full disk while preparing: give back what was reserved (the pieces are fetched again)."""
        for entry in self.manifest.files:
            with contextlib.suppress(OSError):
                os.truncate(self.files / entry.path, 0)

    # --- where a piece's bytes are ------------------------------------------------------------------------

    def segments(self, index: int) -> list[Segment]:
        """The parts of piece ``index`` in the files it spans, in order (empty files span nothing)."""
        start, end = self.manifest.piece_span(index)
        parts: list[Segment] = []
        at = bisect.bisect_right(self._offsets, start) - 1
        files = self.manifest.files
        while start < end:
            entry = files[at]
            high = min(end, entry.offset + entry.size)
            if high > start:
                parts.append(
                    (at, start - entry.offset, start - index * self.manifest.piece_size, high - start)
                )
                start = high
            at += 1
        return parts

    def _fd(self, file_index: int) -> int:
        """An open descriptor of the file (the store keeps serving pieces while ``materialize`` runs in a
        worker thread: once the files are renamed, from their new place)."""
        descriptor = self._data_fds.get(file_index)
        if descriptor is None:
            if len(self._data_fds) >= OPEN_FILES:
                oldest = next(iter(self._data_fds))
                os.close(self._data_fds.pop(oldest))
            path = self.manifest.files[file_index].path
            try:
                descriptor = os.open((self._moved_to or self.files) / path, os.O_RDWR)
            except FileNotFoundError:
                if self._moved_to is None:
                    raise
                descriptor = os.open(self._moved_to / path, os.O_RDWR)  # renamed since we looked
            self._data_fds[file_index] = descriptor
        return descriptor

    def _read_piece(self, index: int) -> bytes:
        """The bytes stored for piece ``index`` (OSError if a file is missing or short)."""
        parts = []
        for file_index, offset, _, length in self.segments(index):
            part = os.pread(self._fd(file_index), length, offset)
            if len(part) != length:
                raise OSError(errno.EIO, "a stored file is shorter than its manifest", str(self.directory))
            parts.append(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

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
        failed: list[int] = []
        try:
            for index in members(claimed):
                if blake3(self._read_piece(index)).digest() == self.manifest.piece_hash(index):
                    good |= 1 << index
                else:
                    failed.append(index)
            if failed:
                log.warning(
                    "%d pieces of %s failed their re-check (first: %d); fetching them again",
                    len(failed),
                    self.directory,
                    failed[0],
                )
        except OSError as exc:
            raise node_error_from_os(exc, f"reading {self.directory}") from exc
        finally:
            self._close_data()
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

    def write(self, index: int, data: bytes, *, digest: bytes | None = None) -> bool:
        """Verify and store piece ``index``. False (nothing written) if the bytes do not match the manifest.
        ``digest``: their BLAKE3, if this node computed it on receipt (``Manifest.piece_is_valid``).

        A failing disk raises NodeError; the piece is then not marked held, so the state stays consistent.
        """
        if not self.manifest.piece_is_valid(index, data, digest=digest):
            return False
        if self.has(index):
            return True
        if self._moved_to is not None:
            raise NodeError(f"{self.directory} was already written out", reason="store_moved")
        view = memoryview(data)
        try:
            for file_index, offset, at, length in self.segments(index):
                written = os.pwrite(self._fd(file_index), view[at : at + length], offset)
                if written != length:
                    raise OSError(
                        errno.EIO, "short write", str(self.files / self.manifest.files[file_index].path)
                    )
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
        try:
            return self._read_piece(index)
        except OSError as exc:
            raise node_error_from_os(exc, f"reading {self.directory}") from exc

    # --- output -----------------------------------------------------------------------------------------

    def materialize(self, out: Path) -> None:
        """Make the checkpoint directory ``out``, atomically (see the module doc): the store's files are
        synced and renamed into place, or copied when ``out`` is on another file system. Afterwards the
        pieces are read from ``out`` until the store is closed, and ``remove`` is all that is left to do.
        Safe to run in a worker thread while the event loop serves pieces with ``read``."""
        if not self.complete:
            missing = self.manifest.piece_count - self.piece_count_held
            raise NodeError(f"cannot write {out}: {missing} pieces are still missing", reason="incomplete")
        if out.exists():
            raise NodeError(
                f"{out} already exists; choose another --out or remove it", reason="output_exists"
            )
        if self._moved_to is not None:
            raise NodeError(f"{self.directory} was already written out", reason="store_moved")
        parent = out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            for stale in parent.glob(f".{out.name}{PARTIAL_MARK}*"):
                shutil.rmtree(stale, ignore_errors=True)  # left by a run killed while copying
            self._sync_files()
            os.chmod(self.files, 0o755)
            try:
                os.rename(self.files, out)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                self._copy_out(out)
            else:
                self._moved_to = out
                fsync_directory(self.directory)
            fsync_directory(parent)
        except OSError as exc:
            raise node_error_from_os(exc, f"writing {out}") from exc

    def _sync_files(self) -> None:
        """Every file, then every directory under ``files``, on disk before the rename makes them the
        checkpoint. Through descriptors of its own: the event loop's stay its own."""
        for entry in self.manifest.files:
            descriptor = os.open(self.files / entry.path, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        for directory in sorted({(self.files / e.path).parent for e in self.manifest.files}, reverse=True):
            fsync_directory(directory)

    def _copy_out(self, out: Path) -> None:
        """``out`` on another file system: copy into a temporary directory beside it, then rename."""
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}{PARTIAL_MARK}", dir=out.parent))
        renamed = False
        try:
            for entry in self.manifest.files:
                target = staging / entry.path
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.files / entry.path, target)
                with open(target, "rb") as handle:
                    os.fsync(handle.fileno())
            for directory in sorted({p.parent for p in staging.rglob("*")}, reverse=True):
                fsync_directory(directory)
            os.chmod(staging, 0o755)
            os.rename(staging, out)
            renamed = True
        finally:
            if not renamed:
                shutil.rmtree(staging, ignore_errors=True)

    def remove(self) -> None:
        self._close_data()
        if self._progress_fd >= 0:
            os.close(self._progress_fd)
            self._progress_fd = -1
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
