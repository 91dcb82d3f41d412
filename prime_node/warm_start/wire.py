"""The warm-start request and reply format on the server's Unix socket (owner and server are the same user).

A request is a 4-byte big-endian length carrying the caller's three stdio descriptors (SCM_RIGHTS),
then that many bytes of JSON: the module to run as ``__main__``, argv, env, cwd, sys.path and the
Python executable. The server answers
with text lines: ``pid N`` once the child exists and ``exit N`` (``subprocess`` return-code convention:
negative for a signal) when it has ended, or ``cold REASON`` when this request must start as a fresh
process instead. Sizes are bounded: nothing on the socket is trusted to be well formed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prime_node.errors import NodeError

MAX_REQUEST_BYTES = 1 << 20
MAX_REPLY_LINE = 256
STDIO_FDS = 3
_LENGTH = struct.Struct(">I")


class WarmStartError(NodeError):
    """A warm-start request or reply that is not well formed, or a server that went away."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="warm_start")


@dataclass(frozen=True)
class Request:
    """What a forked child must look like: the command line, environment, directory and stdio."""

    module: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    sys_path: tuple[str, ...]
    executable: str
    fds: tuple[int, ...] = ()

    def body(self) -> bytes:
        document = {
            "module": self.module,
            "argv": list(self.argv),
            "env": dict(self.env),
            "cwd": self.cwd,
            "sys_path": list(self.sys_path),
            "executable": self.executable,
        }
        return json.dumps(document).encode()


def send_request(sock: socket.socket, request: Request) -> None:
    body = request.body()
    if len(body) > MAX_REQUEST_BYTES:
        raise WarmStartError(f"warm-start request of {len(body)} bytes is over {MAX_REQUEST_BYTES}")
    socket.send_fds(sock, [_LENGTH.pack(len(body))], list(request.fds))
    sock.sendall(body)


def receive_request(sock: socket.socket) -> Request:
    """Read one request; the received descriptors are closed again if it is refused."""
    header, fds, _flags, _address = socket.recv_fds(sock, _LENGTH.size, STDIO_FDS)
    try:
        if len(fds) != STDIO_FDS or len(header) != _LENGTH.size:
            raise WarmStartError(f"warm-start request with {len(fds)} descriptors and a short header")
        (length,) = _LENGTH.unpack(header)
        if length > MAX_REQUEST_BYTES:
            raise WarmStartError(f"warm-start request of {length} bytes is over {MAX_REQUEST_BYTES}")
        return _parse(_read_exactly(sock, length), tuple(fds))
    except BaseException:
        for fd in fds:
            _close_quietly(fd)
        raise


def _parse(body: bytes, fds: tuple[int, ...]) -> Request:
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise WarmStartError(f"warm-start request is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise WarmStartError("warm-start request is not a JSON object")
    argv = _strings(document.get("argv"), "argv")
    sys_path = _strings(document.get("sys_path"), "sys_path")
    env = document.get("env")
    if not isinstance(env, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in env.items()
    ):
        raise WarmStartError("warm-start request: env is not a map of strings")
    cwd, executable, module = document.get("cwd"), document.get("executable"), document.get("module")
    if not isinstance(cwd, str) or not isinstance(executable, str) or not isinstance(module, str) or not argv:
        raise WarmStartError("warm-start request: module, cwd, executable or argv missing")
    return Request(module, tuple(argv), env, cwd, tuple(sys_path), executable, fds)


def _strings(value: object, name: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise WarmStartError(f"warm-start request: {name} is not a list of strings")
    return value


def _read_exactly(sock: socket.socket, length: int) -> bytes:
    chunks, left = [], length
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            raise WarmStartError("warm-start request ended early")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


@dataclass(frozen=True)
class Reply:
    """One line from the server: ``pid``, ``exit`` (with a number) or ``cold`` (with a reason)."""

    kind: str
    number: int = 0
    reason: str = ""


def reply_line(kind: str, value: int | str) -> bytes:
    return f"{kind} {value}\n".encode()


def parse_reply(line: bytes) -> Reply:
    text = line.decode("utf-8", "replace").strip()
    kind, _, rest = text.partition(" ")
    if kind == "cold":
        return Reply("cold", reason=rest[:MAX_REPLY_LINE])
    if kind in ("pid", "exit"):
        try:
            return Reply(kind, number=int(rest))
        except ValueError:
            pass
    raise WarmStartError(f"warm-start server sent an unknown reply: {text[:80]!r}")


def split_lines(buffer: bytearray) -> Sequence[bytes]:
    """Take the complete lines out of ``buffer``; a line longer than allowed is an error."""
    lines = []
    while (end := buffer.find(b"\n")) >= 0:
        lines.append(bytes(buffer[:end]))
        del buffer[: end + 1]
    if len(buffer) > MAX_REPLY_LINE:
        raise WarmStartError("warm-start server sent an over-long line")
    return lines
