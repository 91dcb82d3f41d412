"""A warm-started process as its owner sees it: the subset of ``subprocess.Popen`` that owners use.

``pid`` is the real process (a session leader, so ``os.killpg(pid, ...)`` reaches it and its helpers);
its exit status arrives over the server's socket instead of from ``waitpid``, because the server is
its parent. If the server goes away before saying, the process died with it (it has a death signal)
and the status reads as SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from prime_node.warm_start.wire import WarmStartError, parse_reply, split_lines


class WarmProcess:
    """``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``/``terminate``/``kill`` and the
    parent's ends of any pipes, like ``subprocess.Popen``."""

    def __init__(
        self,
        args: Sequence[str],
        pid: int,
        connection: socket.socket,
        buffered: bytearray,
        streams: tuple[IO[Any] | None, IO[Any] | None, IO[Any] | None],
    ) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self.stdin, self.stdout, self.stderr = streams
        self._connection = connection
        self._buffered = buffered
        self._reading = threading.Lock()  # poll/wait may be called from several threads, as with Popen
        self._take_lines()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read(timeout=left)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Write ``input`` to a piped stdin and read the piped stdout and stderr to their ends (a thread
        each, so that neither side can block the other), then wait."""
        results: dict[str, Any] = {}
        readers = []
        if self.stdin is not None:
            writer = threading.Thread(target=_write_and_close, args=(self.stdin, input), daemon=True)
            writer.start()
            readers.append(writer)
        for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)):
            if stream is not None:
                reader = threading.Thread(target=lambda n=name, s=stream: results.__setitem__(n, s.read()))
                reader.daemon = True
                reader.start()
                readers.append(reader)
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return results.get("stdout"), results.get("stderr")

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()

    def _read(self, timeout: float | None) -> None:
        if not self._reading.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return
        try:
            if self.returncode is None:
                self._read_locked(timeout)
        finally:
            self._reading.release()

    def _read_locked(self, timeout: float | None) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._connection, selectors.EVENT_READ)
            if not selector.select(timeout):
                return
        try:
            data = self._connection.recv(4096)
        except OSError:
            data = b""
        if not data:  # the server died, and its children with it (death signal)
            self.returncode = -signal.SIGKILL
            self._connection.close()
            return
        self._buffered += data
        self._take_lines()

    def _take_lines(self) -> None:
        for line in split_lines(self._buffered):
            reply = parse_reply(line)
            if reply.kind != "exit":
                raise WarmStartError(f"warm-start server sent {reply.kind!r} after the pid")
            self.returncode = reply.number
            self._connection.close()


def _write_and_close(stream: IO[Any], data: Any) -> None:
    with contextlib.suppress(BrokenPipeError, OSError, ValueError):
        if data:
            stream.write(data)
        stream.close()
