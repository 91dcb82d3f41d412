"""Run untrusted Python confined, as root or as an ordinary user: the code task's reward runs hostile code.

One path for everyone: unprivileged user namespaces (see sandbox_launcher.py for the mechanics). The
program sees a new root holding only read-only binds of the Python install and the system libraries,
a size-limited private /tmp (its scratch and working directory) and /dev/shm, a few device nodes and
its own /proc; it has no network (a network namespace with no interface up), no capabilities, no view
of other processes, and rlimits on memory, CPU, processes, file size and open files. It is the child of
PID 1 of its own PID namespace, so when it exits, or the wall-clock timeout here kills the launcher's
process group, the kernel kills everything it forked. Its stdout is discarded; stderr goes to an
in-memory file bounded by the file-size limit, of which the tail is kept.

Where the kernel refuses user namespaces (sysctl off, an AppArmor restriction, a seccomp filter) nothing
runs: ``check_sandbox`` (called when a code task is configured) and ``run_python`` raise NodeError
``sandbox_unavailable`` naming the setting to change. There is no weaker fallback.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from prime_node.errors import NodeError
from prime_node.paths import default_data_dir, default_keystore_path
from prime_node.tasks.sandbox_launcher import TIMED_OUT

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
PROGRAM_PATH = "/tmp/prime-node-sandbox-program.py"  # inside the sandbox's private /tmp
_LIBRARY_DIRS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32")
_FILES = ("/etc/ld.so.cache",)
_STDERR_TAIL = 2000
_LAUNCHER_GRACE_S = 5.0
UNAVAILABLE_HINT = (
    "code tasks run completions in a sandbox built from unprivileged user namespaces, which this system "
    "refuses. Enable them (as root): `sysctl -w user.max_user_namespaces=15000`; on Debian and older "
    "Ubuntu also `sysctl -w kernel.unprivileged_userns_clone=1`; on Ubuntu 23.10 and later "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (or an AppArmor profile that allows "
    "userns for this Python); inside a container, allow the unshare/clone of user namespaces in its "
    "seccomp profile"
)
_PROBE = """\
import _socket, errno, os
s = _socket.socket()
try:
    s.connect(("127.0.0.1", 9))
except OSError as exc:
    assert exc.errno == errno.ENETUNREACH, exc
else:
    raise SystemExit("the sandbox has a network")
try:
    open("/escaped", "w")
except OSError:
    pass
else:
    raise SystemExit("the sandbox's root is writable")
"""


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    returncode: int | None
    timed_out: bool
    wall_s: float
    stderr_tail: str


def sandbox_interpreter() -> Path:
    """The Python binary the program runs on (ours, resolved: its install is what the sandbox exposes)."""
    return Path(sys.executable).resolve()


def _add_symlinks(path: str, links: dict[str, str]) -> None:
    """Record each symlink on the way to ``path`` (e.g. /lib64 -> usr/lib64) to recreate it inside."""
    current = ""
    for part in Path(path).parts[1:]:
        current = f"{current}/{part}"
        if os.path.islink(current):
            links[current] = os.readlink(current)
            current = os.path.realpath(current)


def read_only_tree(interpreter: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """Host directories bound read-only into the sandbox (the Python install, system libraries) and
    the symlinks leading to them."""
    links: dict[str, str] = {}
    real: set[str] = set()
    for path in (sys.base_prefix, sys.base_exec_prefix, str(interpreter.parent), *_LIBRARY_DIRS):
        if os.path.isdir(path):
            _add_symlinks(path, links)
            resolved = os.path.realpath(path)
            if resolved != "/":
                real.add(resolved)
    binds = sorted(p for p in real if not any(p.startswith(q + "/") for q in real))
    inside = [(link, target) for link, target in sorted(links.items()) if not _under(link, binds)]
    return binds, inside


def hidden_inside(binds: list[str]) -> list[str]:
    """The user's home and prime-node's data and keystore dirs where they lie inside a bound install
    (Python installed with prefix ~/.local, say): covered by an empty read-only tmpfs in the sandbox."""
    private = {default_data_dir(), default_keystore_path().parent}
    with contextlib.suppress(RuntimeError, KeyError):  # no home directory known: nothing to hide
        private.add(Path.home())
    found = {os.path.realpath(p) for p in private}
    return sorted(p for p in found if any(p.startswith(b + "/") for b in binds))


def _under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root + "/") for root in roots)


def _process_budget(max_processes: int) -> int:
    """RLIMIT_NPROC for the program. Since Linux 5.14 it counts per user namespace; before, it counts
    every process of the uid, so an ordinary user's own processes are added."""
    release = tuple(int(n) for n in re.findall(r"\d+", os.uname().release)[:2])
    if os.geteuid() == 0 or release >= (5, 14):
        return max_processes + 1  # the sandbox's init shares the program's uid when not root
    own = 0
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and entry.stat().st_uid == os.geteuid():
                own += 1
    return max_processes + 1 + own


def _read_written(fd: int) -> bytes:
    """What the (dead) launcher processes wrote; never blocks, should some unrelated fork of this
    process still hold the write end."""
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _tail(fd: int) -> str:
    size = os.fstat(fd).st_size
    return os.pread(fd, _STDERR_TAIL, max(0, size - _STDERR_TAIL)).decode("utf-8", errors="replace")


def _wait(process: subprocess.Popen[bytes], timeout_s: float) -> int:
    """``process.wait(timeout_s)`` woken by the exit itself (a pidfd), not by Popen's polling, which
    sleeps up to 50 ms past it: this runs once per completion."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except OSError:  # Linux < 5.3
        return process.wait(timeout=timeout_s)
    try:
        if not select.select([pidfd], [], [], timeout_s)[0]:
            raise subprocess.TimeoutExpired(process.args, timeout_s)
    finally:
        os.close(pidfd)
    return process.wait()


def unavailable(detail: str) -> NodeError:
    message = f"the code sandbox cannot start ({detail}): {UNAVAILABLE_HINT}"
    return NodeError(message, reason="sandbox_unavailable")


def run_python(
    source: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_processes: int = 32,
    scratch_mb: int = 8,
) -> SandboxResult:
    """Run ``source`` confined (module docstring); passed = exit status 0 within ``timeout_s``.

    ``scratch_mb`` bounds each of the private /tmp and /dev/shm. Raises NodeError ``sandbox_unavailable``
    when the confinement cannot be built: the program then never ran.
    """
    interpreter = sandbox_interpreter()
    binds, links = read_only_tree(interpreter)
    status_r, status_w = os.pipe()
    program = os.memfd_create("prime-node-sandbox-program")
    stderr = os.memfd_create("prime-node-sandbox-stderr")
    try:
        os.write(program, source.encode("utf-8", errors="surrogateescape"))
        os.lseek(program, 0, os.SEEK_SET)
        config = {
            "status_fd": status_w,
            "interpreter": str(interpreter),
            "program": PROGRAM_PATH,
            "binds": binds,
            "links": links,
            "masks": hidden_inside(binds),
            "files": list(_FILES),
            "memory_bytes": memory_mb << 20,
            "cpu_seconds": max(1, int(timeout_s + 0.999)),
            "nproc": _process_budget(max_processes),
            "file_bytes": 16 << 20,
            "timeout_s": float(timeout_s),
            "tmp_bytes": scratch_mb << 20,
            "shm_bytes": scratch_mb << 20,
        }
        started = time.perf_counter()
        process = subprocess.Popen(
            [str(interpreter), "-I", "-S", "-B", str(LAUNCHER), marshal.dumps(config).hex()],
            stdin=program,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            pass_fds=(status_w,),
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
            close_fds=True,
        )
        os.close(status_w)
        status_w = -1
        try:  # the launcher enforces timeout_s itself and returns once the sandbox is empty
            returncode: int | None = _wait(process, timeout_s + _LAUNCHER_GRACE_S)
        except subprocess.TimeoutExpired:  # a launcher stuck (a loaded machine): kill what we can
            returncode = None
        finally:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)  # launcher, keeper and init: the PID namespace dies
            process.wait()
        wall = time.perf_counter() - started
        lines = _read_written(status_r).decode("utf-8", errors="replace").splitlines()
        timed_out = returncode is None or TIMED_OUT in lines
        returncode = None if timed_out else returncode
        status = [line for line in lines if line.strip() and line != TIMED_OUT]
        tail = _tail(stderr)
    finally:
        for fd in (status_r, status_w, program, stderr):
            if fd >= 0:
                os.close(fd)
    if status:
        raise unavailable(status[-1])
    return SandboxResult(returncode == 0 and not timed_out, returncode, timed_out, wall, tail)


def check_sandbox() -> None:
    """Refuse to run code tasks where programs cannot be confined: call once when a code task is set up."""
    result = run_python(_PROBE, timeout_s=10, memory_mb=256)
    if not result.passed:
        raise unavailable(f"the probe program failed: {result.stderr_tail.strip()[-300:]}")
