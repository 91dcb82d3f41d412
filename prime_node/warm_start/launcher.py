"""The owner's side of warm starts: start the server, turn prime-node command lines into warm processes.

``WarmStart.popen`` takes the arguments ``subprocess.Popen`` would and returns a ``WarmProcess``, or
None when the command is not a prime-node command, the server is not there, or the server says this
request must start cold (another import-time environment); the caller then uses ``subprocess.Popen``.
Setting ``PRIME_NODE_WARM_START=0`` turns warm starts off for everything that would use them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from prime_node.parent_death import death_signal_setter
from prime_node.warm_start.compatibility import ENTRY_MODULES
from prime_node.warm_start.process import WarmProcess
from prime_node.warm_start.wire import Request, WarmStartError, parse_reply, send_request, split_lines

log = logging.getLogger(__name__)

DISABLE_VARIABLE = "PRIME_NODE_WARM_START"
SOCKET_VARIABLE = "PRIME_NODE_WARM_START_SOCKET"
"""Set by an owner in its children's environment: processes that prime-node starts itself (the
``--local`` inference child, trainer ranks) are then forked from the same server."""
SERVER_MODULE = "prime_node.warm_start.server"
CONNECT_WAIT_S = 5.0
PID_WAIT_S = 300.0
"""The server answers a request once it has imported everything: minutes on a loaded 2-core machine."""
STOP_WAIT_S = 10.0

_Stream = int | IO[Any] | None


def enabled(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(DISABLE_VARIABLE, "1") != "0"


def entry_of(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """(module, arguments) of ``python -m MODULE ARGS`` or ``prime-node ARGS`` when MODULE is one a warm
    child may run (None: another program, started cold)."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in ENTRY_MODULES:
        return argv[2], list(argv[3:])
    if argv and Path(argv[0]).name == "prime-node":
        return "prime_node", list(argv[1:])
    return None


def fresh_sys_path(env: Mapping[str, str], cwd: str) -> tuple[str, ...]:
    """The import path ``python -m`` would start with in ``cwd`` under ``env``: the directory, then
    PYTHONPATH, then this interpreter's own entries (ours less our directory and our PYTHONPATH)."""
    ours = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    base = [entry for entry in sys.path[1:] if entry not in ours]
    theirs = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return (cwd, *theirs, *base)


class WarmStart:
    """One warm-start server, owned by this process and stopped with it (a death signal as well)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._env = dict(os.environ if env is None else env)
        self._env.pop(SOCKET_VARIABLE, None)
        self._directory: Path | None = Path(tempfile.mkdtemp(prefix="prime-node-warm-"))
        self.socket_path = self._directory / "server.sock"
        self.log_path = self._directory / "server.log"
        self._server: subprocess.Popen[bytes] | None = None

    @classmethod
    def attach(cls, env: Mapping[str, str] | None = None) -> WarmStart | None:
        """A client of the server an owner named in ``PRIME_NODE_WARM_START_SOCKET`` (None: none named,
        or warm starts are off); it neither starts nor stops that server."""
        environment = os.environ if env is None else env
        path = environment.get(SOCKET_VARIABLE)
        if not path or not enabled(environment):
            return None
        client = cls.__new__(cls)
        client._env = dict(environment)
        client._directory = None
        client.socket_path = Path(path)
        client.log_path = Path(path).with_name("server.log")
        client._server = None
        return client

    def child_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` naming this server, for children that start prime-node processes of their own."""
        return {**env, SOCKET_VARIABLE: str(self.socket_path)}

    def _serving(self) -> bool:
        if self._directory is None:  # attached: the owner keeps the server (it may still be binding)
            return self.socket_path.parent.is_dir()
        return self._server is not None and self._server.poll() is None

    def start(self) -> WarmStart:
        with self.log_path.open("ab") as log_file:
            self._server = subprocess.Popen(
                [sys.executable, "-m", SERVER_MODULE, str(self.socket_path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                env=self._env,
                start_new_session=True,
                preexec_fn=death_signal_setter(signal.SIGTERM),  # noqa: PLW1509
            )
        # It binds its socket before importing anything (~0.1 s): wait for that, so that a request made
        # at once queues at the socket rather than finding no server and starting cold.
        deadline = time.monotonic() + CONNECT_WAIT_S
        while not self.socket_path.exists() and self._serving() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def popen(
        self,
        argv: Sequence[str],
        *,
        stdin: _Stream = None,
        stdout: _Stream = None,
        stderr: _Stream = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        text: bool = False,
    ) -> WarmProcess | None:
        """``subprocess.Popen(argv, ...)`` as a warm child, or None (start it cold)."""
        entry = entry_of(argv)
        if entry is None or not self._serving():
            return None
        module, arguments = entry
        environment = dict(os.environ if env is None else env)
        if not enabled(environment):
            return None
        connection = self._connect()
        if connection is None:
            return None
        ours, theirs = _stdio(stdin, stdout, stderr, text=text)
        directory = str(Path(cwd).resolve() if cwd is not None else Path.cwd())
        try:
            request = Request(
                module=module,
                argv=("prime-node" if module == "prime_node" else module, *arguments),
                env=environment,
                cwd=directory,
                sys_path=fresh_sys_path(environment, directory),
                executable=sys.executable,
                fds=tuple(theirs),
            )
            send_request(connection, request)
            return self._answered(argv, connection, ours)
        except (OSError, WarmStartError) as exc:
            log.warning("warm start failed (%s): starting %s cold", exc, module)
            connection.close()
            _close_all(ours)
            return None
        finally:
            for fd in set(theirs) - {0, 1, 2}:
                os.close(fd)

    def _answered(
        self, argv: Sequence[str], connection: socket.socket, ours: tuple[IO[Any] | None, ...]
    ) -> WarmProcess | None:
        connection.settimeout(PID_WAIT_S)
        buffered = bytearray()
        while True:
            data = connection.recv(4096)
            if not data:
                raise WarmStartError("the warm-start server closed the request unanswered")
            buffered += data
            lines = split_lines(buffered)
            if lines:
                break
        connection.settimeout(None)
        first = parse_reply(lines[0])
        if first.kind == "cold":
            log.info("warm start declined (%s): starting cold", first.reason)
            connection.close()
            _close_all(ours)
            return None
        if first.kind != "pid":
            raise WarmStartError(f"warm-start server answered {first.kind!r} before a pid")
        rest = bytearray(b"".join(line + b"\n" for line in lines[1:])) + buffered
        stdin, stdout, stderr = ours
        log.debug("warm-started %s as pid %d", argv[:4], first.number)
        return WarmProcess(argv, first.number, connection, rest, (stdin, stdout, stderr))

    def _connect(self) -> socket.socket | None:
        deadline = time.monotonic() + CONNECT_WAIT_S
        while True:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connection.connect(str(self.socket_path))
                return connection
            except (FileNotFoundError, ConnectionRefusedError):
                connection.close()
                if time.monotonic() > deadline or not self._serving():
                    return None
                time.sleep(0.02)

    def close(self) -> None:
        """Stop the server (it SIGKILLs any child still running) and remove its directory."""
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(ProcessLookupError):
                server.terminate()
            try:
                server.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)

    def __enter__(self) -> WarmStart:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def _stdio(
    stdin: _Stream, stdout: _Stream, stderr: _Stream, *, text: bool
) -> tuple[tuple[IO[Any] | None, ...], list[int]]:
    """Our ends (pipes we read or write) and the child's three descriptors, as Popen would set them."""
    ours: list[IO[Any] | None] = []
    theirs: list[int] = []
    for index, spec in enumerate((stdin, stdout, stderr)):
        reading = index > 0
        if spec is None:
            theirs.append(os.dup(index))
            ours.append(None)
        elif spec == subprocess.DEVNULL:
            theirs.append(os.open(os.devnull, os.O_WRONLY if reading else os.O_RDONLY))
            ours.append(None)
        elif spec == subprocess.PIPE:
            read_end, write_end = os.pipe()
            theirs.append(write_end if reading else read_end)
            mine = read_end if reading else write_end
            raw = open(mine, "rb" if reading else "wb", buffering=-1 if reading else 0)  # noqa: SIM115
            ours.append(io.TextIOWrapper(raw, encoding="utf-8") if text else raw)
        elif spec == subprocess.STDOUT and index == 2:
            theirs.append(os.dup(theirs[1]))
            ours.append(None)
        elif isinstance(spec, int):
            theirs.append(os.dup(spec))
            ours.append(None)
        else:
            theirs.append(os.dup(spec.fileno()))
            ours.append(None)
    return tuple(ours), theirs


def _close_all(streams: tuple[IO[Any] | None, ...]) -> None:
    for stream in streams:
        if stream is not None:
            stream.close()
