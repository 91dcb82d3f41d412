"""The sandbox's launcher: a fresh, single-threaded ``python -I -S`` that confines one program, without root.

Run as a script (``python -I -S -B sandbox_launcher.py CONFIG``, CONFIG a hex-encoded marshal of a dict),
never imported by the node, so it may fork freely; it imports only cheap builtin modules (it runs per
completion: json, re and signal would add ~25 ms). The program's source arrives on stdin, setup errors go
to the status fd named in the config (empty status = the program was started). Three processes:

- **launcher** (initial namespaces) forks the **keeper** and, once the keeper has made its namespaces,
  writes the keeper's uid/gid maps (from outside, so root may map a throw-away uid; an ordinary user maps
  only itself), then waits for it;
- **keeper** ``unshare``s a user, mount, network, PID, IPC and UTS namespace and forks the **init**;
- **init**, PID 1 of the new PID namespace, builds a new root on a tmpfs (read-only binds of the Python
  install and system libraries, a few device nodes, a fresh /proc, size-limited tmpfs /tmp and /dev/shm),
  ``pivot_root``s into it, detaches the old root, forks the program and exits when the program exits. The
  kernel then kills everything left in the PID namespace: nothing the program forked outlives it. At the
  time limit the keeper SIGKILLs the init, with the same effect.

The program runs as uid 1000 of the user namespace (no capabilities: ``execve`` as non-zero uid drops
them, plus ``no_new_privs``), under rlimits, in a network namespace with no interface up, seeing only the
new root. Mounts made here are locked read-only for any namespace the program nests.
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import select
import sys

TYPE_CHECKING = False  # typing itself costs ~10 ms of startup; mypy treats this name as true
if TYPE_CHECKING:
    from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
SIGKILL = 9
TIMED_OUT = "timed out"  # the one status line that is not a setup failure
INNER_ID = 1000  # the program's uid and gid inside the user namespace: not 0, so exec drops capabilities
DEVICES = ("null", "zero", "full", "random", "urandom")
# statvfs flag -> mount flag: a remount inside a user namespace must keep the flags it inherited.
_KEPT_FLAGS = {
    2: MS_NOSUID,
    4: MS_NODEV,
    8: MS_NOEXEC,
    1024: MS_NOATIME,
    2048: MS_NODIRATIME,
    4096: MS_RELATIME,
}


class SetupError(Exception):
    """A step of the confinement failed: reported on the status fd, the program never runs."""


def _c_string(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


class Libc:
    """The few system calls Python 3.11's os module lacks."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)

    def _check(self, what: str, result: int) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise SetupError(f"{what}: {os.strerror(errno)} (errno {errno})")

    def unshare(self, flags: int) -> None:
        self._check("unshare", self._libc.unshare(ctypes.c_int(flags)))

    def mount(
        self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None
    ) -> None:
        result = self._libc.mount(
            _c_string(source), target.encode(), _c_string(fstype), ctypes.c_ulong(flags), _c_string(data)
        )
        self._check(f"mount {source or fstype} on {target}", result)

    def umount(self, target: str) -> None:
        self._check(f"umount {target}", self._libc.umount2(target.encode(), ctypes.c_int(MNT_DETACH)))

    def pivot_root(self, new_root: str, put_old: str) -> None:
        self._check("pivot_root", self._libc.pivot_root(new_root.encode(), put_old.encode()))

    def prctl(self, option: int, value: int) -> None:
        args = (ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
        self._check(f"prctl {option}", self._libc.prctl(ctypes.c_int(option), *args))


def _report(status_fd: int, message: str) -> None:
    try:  # noqa: SIM105 (contextlib costs ~5 ms of startup here)
        os.write(status_fd, message.encode("utf-8", "replace")[:4000] + b"\n")
    except OSError:
        pass


def _unescape(field: bytes) -> str:
    """A mountinfo path: octal escapes (\\040 for a space) decoded."""
    parts = field.split(b"\\")
    out = bytearray(parts[0])
    for part in parts[1:]:
        out += bytes([int(part[:3], 8)]) + part[3:]
    return out.decode("utf-8", "surrogateescape")


def _exit_code(wait_status: int) -> int:
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _spare_id(map_path: str) -> int | None:
    """An id of our own namespace other than root's, for the program when we are root (random, so
    concurrent sandboxes differ); None when only one id is mapped (e.g. ``unshare -r``)."""
    with open(map_path, encoding="ascii") as handle:
        for line in handle:
            inside, _outside, count = (int(field) for field in line.split())
            low = max(inside, 1, min(2_000_000, inside + count // 2))
            high = inside + count
            if low < high:
                return low + int.from_bytes(os.urandom(3), "big") % min(high - low, 1_000_000)
    return None


def _map_ids(pid: int) -> None:
    """Give the keeper's user namespace its ids: root maps a throw-away id, a user maps only itself."""
    uid, gid = os.geteuid(), os.getegid()
    spare_uid, spare_gid = _spare_id("/proc/self/uid_map"), _spare_id("/proc/self/gid_map")
    if uid == 0 and spare_uid is not None and spare_gid is not None:
        _write(f"/proc/{pid}/uid_map", f"0 0 1\n{INNER_ID} {spare_uid} 1\n")
        _write(f"/proc/{pid}/gid_map", f"0 {gid} 1\n{INNER_ID} {spare_gid} 1\n")
    else:
        _write(f"/proc/{pid}/setgroups", "deny")
        _write(f"/proc/{pid}/uid_map", f"{INNER_ID} {uid} 1\n")
        _write(f"/proc/{pid}/gid_map", f"{INNER_ID} {gid} 1\n")


def _makedirs(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)


def _mount_points_under(root: str) -> list[str]:
    """Mount points at or below ``root`` (this process's view), parents first."""
    found = []
    with open("/oldroot/proc/self/mountinfo", "rb") as handle:
        for line in handle:
            point = _unescape(line.split()[4])
            if point == root or point.startswith(root + "/"):
                found.append(point)
    return sorted(found, key=len)


def _remount_read_only(libc: Libc, target: str) -> None:
    for point in _mount_points_under(target):
        flags = os.statvfs(point).f_flag
        kept = sum(flag for bit, flag in _KEPT_FLAGS.items() if flags & bit)
        libc.mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept, None)


def _bind(libc: Libc, source: str, *, read_only: bool) -> None:
    """Bind host ``source`` (seen under /oldroot) at the same path of the new root."""
    target = "/newroot" + source
    if os.path.isdir("/oldroot" + source):
        _makedirs(target)
    else:
        _makedirs(os.path.dirname(target))
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    libc.mount("/oldroot" + source, target, None, MS_BIND | MS_REC, None)
    if read_only:
        _remount_read_only(libc, target)


def _build_root(libc: Libc, config: dict[str, Any], source: bytes) -> None:
    """Make the new root the only filesystem this process sees (see the module docstring)."""
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    libc.mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
    os.chdir("/tmp")
    os.mkdir("newroot")
    libc.mount("tmpfs", "newroot", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    os.mkdir("oldroot")
    libc.pivot_root(".", "oldroot")
    os.chdir("/")
    for point, size in (("/tmp", config["tmp_bytes"]), ("/dev/shm", config["shm_bytes"])):
        _makedirs("/newroot" + point)
        libc.mount("tmpfs", "/newroot" + point, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")
    for path in config["binds"]:
        _bind(libc, path, read_only=True)
    for path in config["files"]:
        if os.path.exists("/oldroot" + path):
            _bind(libc, path, read_only=True)
    for path in config["masks"]:  # the user's files inside a bound install (e.g. a prefix of ~/.local)
        if os.path.isdir("/newroot" + path):
            libc.mount("tmpfs", "/newroot" + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
    for link, target in config["links"]:
        _makedirs(os.path.dirname("/newroot" + link))
        if not os.path.lexists("/newroot" + link):
            os.symlink(target, "/newroot" + link)
    for device in DEVICES:
        if os.path.exists("/oldroot/dev/" + device):
            _bind(libc, "/dev/" + device, read_only=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "0"), ("stdout", "1"), ("stderr", "2")):
        os.symlink(target if name == "fd" else f"/proc/self/fd/{target}", f"/newroot/dev/{name}")
    _makedirs("/newroot/proc")
    try:  # noqa: SIM105 (contextlib costs ~5 ms of startup here)
        libc.mount("proc", "/newroot/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    except SetupError:  # refused where the host's /proc is partly masked (some containers): no /proc then
        pass
    with open("/newroot" + config["program"], "wb") as handle:
        handle.write(source)
        os.fchmod(handle.fileno(), 0o644)
    libc.umount("/oldroot")
    os.chdir("/newroot")
    libc.pivot_root(".", ".")  # stack the base tmpfs on top, then drop it: "/" is the new root
    libc.umount(".")
    os.chdir("/")
    libc.mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    os.chdir(os.path.dirname(config["program"]))


def _limit(config: dict[str, Any]) -> None:
    """Lower each limit (never above what we were given: raising a hard limit needs privilege)."""
    cpu = config["cpu_seconds"]
    for kind, wanted_soft, wanted_hard in (
        (resource.RLIMIT_AS, config["memory_bytes"], config["memory_bytes"]),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_FSIZE, config["file_bytes"], config["file_bytes"]),
        (resource.RLIMIT_NOFILE, 64, 64),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NPROC, config["nproc"], config["nproc"]),
    ):
        ceiling = resource.getrlimit(kind)[1]
        if ceiling == resource.RLIM_INFINITY:
            ceiling = wanted_hard
        resource.setrlimit(kind, (min(wanted_soft, ceiling), min(wanted_hard, ceiling)))


def _run_program(libc: Libc, config: dict[str, Any], status_fd: int) -> None:
    """In the init's child: drop to the inner uid, set limits, exec the interpreter (never returns)."""
    try:
        os.setresgid(INNER_ID, INNER_ID, INNER_ID)
        os.setresuid(INNER_ID, INNER_ID, INNER_ID)
        _limit(config)
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        interpreter = config["interpreter"]
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONHASHSEED": "0"}
        os.execve(interpreter, [interpreter, "-I", "-S", "-B", config["program"]], env)
    except BaseException as exc:
        _report(status_fd, f"starting the program: {exc}")
    os._exit(127)


def _init(libc: Libc, config: dict[str, Any], source: bytes, status_fd: int) -> None:
    """PID 1 of the sandbox: build the root, run the program, exit with its status (never returns)."""
    try:
        libc.prctl(PR_SET_DUMPABLE, 0)  # the program (same uid when not root) may not ptrace us
        os.umask(0o022)  # the program's uid must read what we create, whatever the node's umask
        _build_root(libc, config, source)
        program = os.fork()
        if program == 0:
            _run_program(libc, config, status_fd)
    except BaseException as exc:
        _report(status_fd, f"building the sandbox: {exc}")
        os._exit(126)
    os.close(status_fd)
    try:  # reap orphans until the program exits (a SIGINT from the program ends it all early, as a failure)
        while True:
            pid, wait_status = os.wait()
            if pid == program:
                os._exit(_exit_code(wait_status))
    finally:
        os._exit(126)


def _keeper(libc: Libc, config: dict[str, Any], source: bytes, status_fd: int, ready: int, go: int) -> None:
    """Make the namespaces, wait for the id maps, fork the init, and wait for it at most the time limit:
    then SIGKILL it. Exits only once the init is reaped, i.e. once the PID namespace is empty (the kernel
    kills and reaps the rest before the init's exit completes), so the caller's wait means all is gone."""
    try:
        libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS)
        libc.prctl(PR_SET_PDEATHSIG, SIGKILL)
        os.write(ready, b"1")
        if os.read(go, 1) != b"1":
            os._exit(126)
        lifeline_r, lifeline_w = os.pipe()  # held by the init alone (close-on-exec: not by the program)
        init = os.fork()
        if init == 0:
            os.close(lifeline_r)
            libc.prctl(PR_SET_PDEATHSIG, SIGKILL)
            _init(libc, config, source, status_fd)
        os.close(lifeline_w)
        if not select.select([lifeline_r], [], [], config["timeout_s"])[0]:
            os.kill(init, SIGKILL)
            _report(status_fd, TIMED_OUT)
        os.close(status_fd)
        os._exit(_exit_code(os.waitpid(init, 0)[1]))
    except BaseException as exc:
        _report(status_fd, f"creating namespaces: {exc}")
    os._exit(126)


def main() -> None:
    config = marshal.loads(bytes.fromhex(sys.argv[1]))
    status_fd = int(config["status_fd"])
    os.set_inheritable(status_fd, False)  # closed by the program's exec: only setup failures are written
    try:
        chunks = []
        while chunk := os.read(0, 1 << 20):
            chunks.append(chunk)
        source = b"".join(chunks)
        libc = Libc()
        if os.geteuid() == 0:
            try:  # noqa: SIM105 (contextlib costs ~5 ms of startup here)
                os.setgroups([])  # no supplementary groups (root's group 0 above all)
            except PermissionError:  # root of a user namespace with setgroups denied: none to drop
                pass
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        keeper = os.fork()
        if keeper == 0:
            os.close(ready_r)
            os.close(go_w)
            _keeper(libc, config, source, status_fd, ready_w, go_r)
        os.close(ready_w)
        os.close(go_r)
        if os.read(ready_r, 1) == b"1":
            try:
                _map_ids(keeper)
            except OSError as exc:
                _report(status_fd, f"writing the user namespace's id maps: {exc}")
            else:
                os.write(go_w, b"1")
        os.close(go_w)
        os.close(status_fd)
        os._exit(_exit_code(os.waitpid(keeper, 0)[1]))
    except BaseException as exc:
        _report(status_fd, f"launcher: {exc}")
    os._exit(126)


if __name__ == "__main__":
    main()
