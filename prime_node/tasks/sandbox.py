"""Run untrusted Python in a subprocess with time, memory, process and network limits.

Layers, from the outside in:
- wall-clock timeout in the parent; on expiry the child's process group is SIGKILLed and every process
  still owned by the sandbox's throw-away uid is killed by pid;
- a launcher (a separate, single-threaded Python process, so no fork-safety issues in the trainer)
  that, before exec'ing the program:
  * enters a new network namespace (``unshare(CLONE_NEWNET)``, needs root/CAP_SYS_ADMIN): no interface
    is up there, not even loopback, so every connect fails;
  * sets rlimits: address space (memory), CPU seconds, file size, open files, no core dumps;
  * when root, drops to a fresh unprivileged uid/gid with RLIMIT_NPROC, which bounds fork bombs (root
    itself ignores RLIMIT_NPROC);
- Python's isolated mode (``-I -S``) and a prologue that replaces socket constructors (defence in depth
  where the namespace is unavailable, i.e. not running as root).
The program's stdout is discarded; stderr goes to a size-limited file. Files are not isolated beyond
the unprivileged uid: the code can read world-readable files but write nowhere it does not own.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prime_node.errors import NodeError

_LAUNCHER = r"""
import ctypes, os, resource, sys
uid, memory, cpu, nproc = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
interpreter, target = sys.argv[5], sys.argv[6]
libc = ctypes.CDLL(None, use_errno=True)
libc.unshare(0x40000000)  # CLONE_NEWNET; fails without root/CAP_SYS_ADMIN (the prologue still applies)
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if os.getuid() == 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
os.execv(interpreter, [interpreter, "-I", "-S", "-B", target])
"""

_PROLOGUE = """\
import socket as _prime_socket
def _prime_no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")
_prime_socket.socket = _prime_no_network
_prime_socket.create_connection = _prime_no_network
_prime_socket.socketpair = _prime_no_network
del _prime_socket, _prime_no_network
"""

_UID_BASE = 2_000_000
_uid_counter = itertools.count()
_uid_lock = threading.Lock()


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    returncode: int | None
    timed_out: bool
    wall_s: float
    stderr_tail: str


def _world_executable(path: Path) -> bool:
    """Whether an unprivileged uid can run ``path`` (the file and every parent directory)."""
    try:
        if path.stat().st_mode & 0o005 != 0o005:
            return False
        return all(parent.stat().st_mode & 0o001 for parent in path.parents)
    except OSError:
        return False


def sandbox_interpreter() -> Path:
    """A Python the sandbox uid may execute: ours if world-executable, else the system's python3."""
    for candidate in (
        Path(sys.executable).resolve(),
        Path("/usr/bin/python3").resolve(),
        Path("/usr/local/bin/python3").resolve(),
    ):
        if candidate.is_file() and (os.getuid() != 0 or _world_executable(candidate)):
            return candidate
    raise NodeError(
        "no Python interpreter an unprivileged user can execute was found for the code sandbox",
        reason="sandbox_unavailable",
    )


def _fresh_uid() -> int:
    with _uid_lock:
        return _UID_BASE + (os.getpid() % 10_000) * 1000 + next(_uid_counter) % 1000


def _kill_uid(uid: int) -> None:
    """SIGKILL every process owned by the sandbox uid (found by scanning /proc), by pid."""
    for _ in range(3):
        found = False
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            line = next((ln for ln in status.splitlines() if ln.startswith("Uid:")), "")
            if line.split()[1:2] == [str(uid)]:
                found = True
                with contextlib.suppress(OSError):
                    os.kill(int(entry.name), signal.SIGKILL)
        if not found:
            return
        time.sleep(0.01)


def run_python(
    source: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_processes: int = 32
) -> SandboxResult:
    """Run ``source`` as a Python program under the limits above; passed = exit status 0 in time."""
    uid = _fresh_uid()
    as_root = os.getuid() == 0
    with tempfile.TemporaryDirectory(prefix="prime-node-sandbox-") as tmp:
        folder = Path(tmp)
        os.chmod(folder, 0o755)
        program = folder / "main.py"
        program.write_text(_PROLOGUE + source, encoding="utf-8")
        os.chmod(program, 0o644)
        stderr_path = folder / "stderr.txt"
        cpu_seconds = max(1, int(timeout_s + 0.999))
        started = time.perf_counter()
        timed_out = False
        with open(stderr_path, "wb") as stderr:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    "-c",
                    _LAUNCHER,
                    str(uid),
                    str(memory_mb << 20),
                    str(cpu_seconds),
                    str(max_processes),
                    str(sandbox_interpreter()),
                    str(program),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                cwd=folder,
                env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"},
                start_new_session=True,
                close_fds=True,
            )
            try:
                returncode: int | None = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                returncode = None
            finally:
                with contextlib.suppress(OSError):
                    os.killpg(process.pid, signal.SIGKILL)
                if as_root:
                    _kill_uid(uid)
                process.wait()
        wall = time.perf_counter() - started
        with open(stderr_path, "rb") as handle:
            handle.seek(max(0, stderr_path.stat().st_size - 2000))
            tail = handle.read().decode("utf-8", errors="replace")
    return SandboxResult(returncode == 0 and not timed_out, returncode, timed_out, wall, tail)
