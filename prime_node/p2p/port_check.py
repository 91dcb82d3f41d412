"""Refuse a listen port another process already listens on, and say which process.

py-libp2p sets SO_REUSEPORT on its TCP listener (hole punching dials out from the listen port), and Linux
lets a second socket with SO_REUSEPORT of the same user bind the same address: a second ``join`` on a
port in use started, advertised that port under its own peer id and took half the first node's incoming
connections (issue 36). A plain bind without SO_REUSEPORT still fails against any listener, so binding
one for a moment tells whether the port is free. It can race with a process binding in between; it is
the operator's mistake it catches, not an attacker's.

Who holds the port is read from ``/proc`` (Linux: the listening socket's inode in ``/proc/net/tcp*``,
then the process whose file descriptors include it); elsewhere, or without permission, the message says
only that the port is in use.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
from pathlib import Path

from prime_node.errors import NodeError

log = logging.getLogger(__name__)
TCP_LISTEN = "0A"
MAX_PROCESSES_SCANNED = 4096


def ensure_port_free(host: str, port: int, *, what: str = "listen", proc: Path = Path("/proc")) -> None:
    """NodeError ``port_in_use`` if ``host:port`` cannot be bound by a socket without SO_REUSEPORT (port 0
    is always free: the kernel picks one)."""
    if port == 0:
        return
    family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed socket's TIME_WAIT is no owner
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return  # not ours to judge (no such address, no permission): the real bind reports it
            holder = listener_pid(port, proc)
            by = "" if holder is None else f" (by pid {holder[0]}: {holder[1]})"
            raise NodeError(
                f"port {port} is in use{by}: cannot {what} on {host}:{port}; stop that process or pick "
                "another port",
                reason="port_in_use",
            ) from None


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def listener_pid(port: int, proc: Path = Path("/proc")) -> tuple[int, str] | None:
    """(pid, command line) of a process with a TCP socket listening on ``port``, if ``/proc`` tells."""
    inodes = _listening_inodes(port, proc)
    if not inodes:
        return None
    try:
        entries = sorted(proc.iterdir(), key=lambda p: p.name)[:MAX_PROCESSES_SCANNED]
    except OSError:
        return None
    for entry in entries:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(entry.name), _command(entry)
        except OSError:
            continue  # gone, or not ours to read
    return None


def _listening_inodes(port: int, proc: Path) -> set[str]:
    inodes: set[str] = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != TCP_LISTEN:
                continue
            local = fields[1].rsplit(":", 1)
            if len(local) == 2 and int(local[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _command(process: Path) -> str:
    try:
        raw = (process / "cmdline").read_bytes()[:400]
    except OSError:
        return "?"
    words = [word.decode(errors="replace") for word in raw.split(b"\0") if word]
    return " ".join(words[:6]) or "?"
