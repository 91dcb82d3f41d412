"""One running node per data dir.

A second ``run-trainer`` on a data dir in use failed on a symptom (a race with the first trainer's
checkpoint rotation) and on its way out rewrote the first node's node.json to ``"stopped"``, so
``prime-node status`` called the running trainer stopped (issue 36). The node now holds an exclusive lock
on ``DATA_DIR/node.lock`` (flock: the kernel drops it when the process dies, so a crash leaves no stale
lock) for as long as it runs, and writes node.json only while it holds it. A second node reads who holds
the lock (the holder writes its pid and command into the file) and stops before touching anything.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path
from types import TracebackType

from prime_node.errors import NodeError

LOCK_FILE = "node.lock"
MAX_HOLDER_TEXT = 300


class DataDirLock:
    """``with DataDirLock(directory):`` the data dir is this process's (NodeError ``data_dir_busy`` if
    another process holds it)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fd: int | None = None

    def __enter__(self) -> DataDirLock:
        path = self.directory / LOCK_FILE
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            why = f"cannot use data dir {self.directory}: {exc.strerror}"
            raise NodeError(why, reason="data_dir") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise NodeError(
                f"data dir {self.directory} is in use by {holder}: stop that node first, or pass another "
                "--data-dir",
                reason="data_dir_busy",
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} ({' '.join(sys.argv[:8])[:MAX_HOLDER_TEXT]})\n".encode())
        self._fd = fd
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock; the text stays as a note of the last holder
            self._fd = None


def check_data_dir_free(directory: Path) -> None:
    """NodeError ``data_dir_busy`` if a running node holds ``directory`` (a command that does work before
    its node starts checks first; the node then takes the lock for good)."""
    if directory.is_dir():
        with DataDirLock(directory):
            pass


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, MAX_HOLDER_TEXT, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    printable = "".join(ch if ch.isprintable() else " " for ch in text)
    return printable or "another prime-node process"
