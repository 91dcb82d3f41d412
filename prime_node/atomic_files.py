"""Replace a file all at once: a reader (or a restart after a crash) sees the old content or the new, never
half of it.

The new content goes to a temporary file in the same directory (a rename is atomic only within one file
system), is flushed and fsynced, renamed over the target, and the directory is fsynced so the rename
itself survives a power cut. Every failure is a NodeError with a stable reason; the temporary is removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Literal, overload

from crypto.randomness import random_bytes
from prime_node.errors import NodeError


def node_error_from_os(exc: OSError, action: str) -> NodeError:
    """One clear line for the errors a user can fix (a full disk, a permission), with a stable reason."""
    where = f" {exc.filename}" if exc.filename else ""
    if exc.errno == errno.ENOSPC:
        return NodeError(f"disk full while {action}{where}", reason="disk_full")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return NodeError(f"permission denied while {action}{where}", reason="permission_denied")
    return NodeError(f"cannot {action}{where}: {exc.strerror or exc}", reason="io_error")


def fsync_path(path: Path) -> None:
    """Flush ``path`` to disk: a file's data, or a directory's entries (raises OSError)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_directory(directory: Path) -> None:
    """Make a rename or a new name in ``directory`` durable (raises OSError)."""
    fsync_path(directory)


def temporary_sibling(path: Path) -> Path:
    """A fresh hidden name next to ``path``: unique per process and call, so writers never collide."""
    return path.with_name(f".{path.name}.{os.getpid()}.{random_bytes(4).hex()}.tmp")


@overload
def atomic_writer(
    path: Path, *, text: Literal[False] = False, durable: bool = True
) -> contextlib.AbstractContextManager[IO[bytes]]: ...
@overload
def atomic_writer(
    path: Path, *, text: Literal[True], durable: bool = True
) -> contextlib.AbstractContextManager[IO[str]]: ...
def atomic_writer(
    path: Path, *, text: bool = False, durable: bool = True
) -> contextlib.AbstractContextManager[IO[bytes] | IO[str]]:
    """``with atomic_writer(path) as handle:`` write the new content; it replaces ``path`` when the block
    ends without an exception, and is thrown away otherwise. OSError becomes NodeError.

    ``durable=False`` skips the fsyncs: still all-or-nothing for readers, but a power cut may lose the
    update. Only for files rewritten very often whose content is re-checked on load anyway (a piece
    store's progress bitfield, written after every piece)."""
    return _atomic_writer(path, text, durable)


@contextlib.contextmanager
def _atomic_writer(path: Path, text: bool, durable: bool) -> Iterator[IO[bytes] | IO[str]]:
    temporary = temporary_sibling(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "w" if text else "wb", encoding="utf-8" if text else None) as handle:
            yield handle
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, path)
        if durable:
            fsync_directory(path.parent)
    except OSError as exc:
        raise node_error_from_os(exc, f"writing {path}") from exc
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


def write_atomically(path: Path, data: bytes | str, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` (str is written as UTF-8), durably unless told otherwise (see
    ``atomic_writer``); NodeError on failure."""
    with atomic_writer(path, durable=durable) as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
