"""Hostile programs in the code sandbox, run as the current user and as an unprivileged uid.

Each attack tries to leave an effect the test can see from outside: a connection to a socket the test
listens on, the text of a secret in a keystore-like file, a marker file outside the scratch dir, a
detached process (and the file it writes after the check), 15 MiB files in /dev/shm and /tmp. The
harness (``attack``) runs them all through ``run_python`` and reports what escaped; when the test runs
as root it runs the harness a second time as uid 65534 in a child process (``python -m`` this module),
because a home user is not root. The kernel refusing user namespaces is made real, not faked: a user
namespace whose ``user.max_user_namespaces`` is 0.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prime_node.errors import NodeError
from prime_node.tasks.sandbox import (
    check_sandbox,
    hidden_inside,
    read_only_tree,
    run_python,
    sandbox_interpreter,
)
from tests.tasks.processes import new_tag, processes_named

UNPRIVILEGED = 65534
FILL_MB = 15
ROOT = Path(__file__).resolve().parents[2]
OUTSIDE_TMP = "/var/tmp" if os.path.isdir("/var/tmp") else None

ATTACKS = {
    # Straight to the C socket module: no Python-level guard can stop this.
    "network": """
import _socket
s = _socket.socket()
s.settimeout(2)
s.connect(("127.0.0.1", {port}))
s.sendall(b"escaped")
""",
    "secret": """
import sys
sys.stderr.write("SECRET=" + open({secret!r}).read())
""",
    "marker": """
open({marker!r}, "w").write("escaped")
""",
    "child": """
import ctypes, os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(15, {tag!r}.encode()[:15], 0, 0, 0)  # PR_SET_NAME: findable in /proc
        time.sleep(1.0)
        open({child_marker!r}, "w").write("outlived the check")
        time.sleep(30)
    os._exit(0)
""",
    "fill": """
import sys
for folder in ("/dev/shm", "/tmp"):
    written = 0
    try:
        with open(folder + "/" + {tag!r}, "wb") as handle:
            for _ in range({fill_mb}):
                handle.write(b"x" * (1 << 20))
                handle.flush()
                written += 1
    except OSError as exc:
        sys.stderr.write(f"{{folder}}: {{exc}}\\n")
    sys.stderr.write(f"WROTE {{folder}} {{written}}\\n")
""",
}


def attack(workdir: Path) -> dict[str, Any]:
    """Run every attack; return, per attack, whether it escaped and the evidence (also: did it start)."""
    home = workdir / "home"
    keystore = home / ".local" / "share" / "prime-node"
    keystore.mkdir(parents=True, exist_ok=True)
    secret = keystore / "keystore.json"
    secret_text = f"wallet-secret-{uuid.uuid4().hex}"
    secret.write_text(secret_text)
    secret.chmod(0o600)
    outside = workdir / "outside"
    outside.mkdir(exist_ok=True)
    tag = new_tag()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    values = {
        "port": listener.getsockname()[1],
        "secret": str(secret),
        "marker": str(outside / "marker"),
        "child_marker": str(outside / "child_marker"),
        "tag": tag,
        "fill_mb": FILL_MB,
    }
    report: dict[str, Any] = {"uid": os.getuid(), "sandbox": sys.modules[run_python.__module__].__file__}
    try:
        for name, template in ATTACKS.items():
            source = 'import sys\nsys.stderr.write("STARTED\\n")\n' + template.format(**values)
            try:
                result = run_python(source, timeout_s=5.0, memory_mb=256)
            except NodeError as exc:
                report[name] = {"escaped": None, "error": str(exc)}
                continue
            entry: dict[str, Any] = {"started": "STARTED" in result.stderr_tail, "tail": result.stderr_tail}
            if name == "network":
                try:
                    connection, _ = listener.accept()
                    connection.close()
                    entry["escaped"] = True
                except BlockingIOError:
                    entry["escaped"] = False
            elif name == "secret":
                entry["escaped"] = secret_text in result.stderr_tail
            elif name == "marker":
                entry["escaped"] = Path(values["marker"]).exists()
            elif name == "child":
                alive_after_check = processes_named(tag)
                time.sleep(1.5)
                entry["escaped"] = bool(alive_after_check) or Path(values["child_marker"]).exists()
                entry["alive_after_check"] = alive_after_check
                for pid in processes_named(tag):
                    os.kill(pid, 9)
            elif name == "fill":
                left = [f"{d}/{tag}" for d in ("/dev/shm", "/tmp") if Path(f"{d}/{tag}").exists()]
                entry["escaped"] = bool(left)
                entry["left_behind"] = left
                for path in left:
                    os.unlink(path)
            report[name] = entry
    finally:
        listener.close()
    return report


def _others_can_enter(path: Path) -> bool:
    return bool(path.stat().st_mode & stat.S_IXOTH)


def _blocked_ancestors(paths: list[Path]) -> dict[str, set[str]]:
    """For each path, the first ancestor another uid cannot enter, and its child on the way."""
    blocked: dict[str, set[str]] = {}
    for path in paths:
        parts = path.resolve().parts
        for depth in range(1, len(parts)):
            ancestor = Path(*parts[:depth])
            if not _others_can_enter(ancestor):
                blocked.setdefault(str(ancestor), set()).add(parts[depth])
                break
    return blocked


# Runs as root in a fresh mount namespace: make the Python install and this checkout reachable by the
# unprivileged uid (a tmpfs over e.g. /root holding only binds of what is needed), drop to that uid,
# then run the harness. Nothing changes outside that namespace.
_DROP_TO_USER = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
spec = json.loads(sys.argv[1])
if spec["blocked"]:
    assert libc.unshare(0x00020000) == 0, os.strerror(ctypes.get_errno())
    assert libc.mount(None, b"/", None, 16384 | (1 << 18), None) == 0
    for ancestor, children in spec["blocked"].items():
        fds = {child: os.open(os.path.join(ancestor, child), os.O_PATH) for child in children}
        assert libc.mount(b"tmpfs", ancestor.encode(), b"tmpfs", 0, b"mode=0755,size=64k") == 0
        for child, fd in fds.items():
            os.mkdir(os.path.join(ancestor, child))
            source = f"/proc/self/fd/{fd}".encode()
            assert libc.mount(source, os.path.join(ancestor, child).encode(), None, 4096 | 16384, None) == 0
            os.close(fd)
os.setgroups([])
os.setgid(spec["uid"])
os.setuid(spec["uid"])
os.environ["HOME"] = spec["home"]
os.execv(sys.executable, [sys.executable, "-m", "tests.tasks.test_sandbox_confinement", spec["workdir"]])
"""


def _attack_as_unprivileged_user() -> dict[str, Any]:
    needed = [Path(sys.executable).resolve(), Path(sys.base_prefix), Path(sys.prefix), ROOT]
    blocked = _blocked_ancestors(needed)
    workdir = _workdir()
    try:
        for path in (workdir, workdir / "home"):
            path.mkdir(exist_ok=True)
            os.chown(path, UNPRIVILEGED, UNPRIVILEGED)
        workdir.chmod(0o755)
        (workdir / "home").chmod(0o700)
        spec = {"blocked": {k: sorted(v) for k, v in blocked.items()}, "uid": UNPRIVILEGED}
        spec |= {"home": str(workdir / "home"), "workdir": str(workdir)}
        done = subprocess.run(
            [sys.executable, "-c", _DROP_TO_USER, json.dumps(spec)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            pytest.fail(f"the unprivileged harness failed:\n{done.stderr[-3000:]}")
        report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
        return report
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def sandbox_works() -> None:
    """Skip (as an ordinary user) where this kernel refuses the sandbox: the refusal test covers that."""
    try:
        check_sandbox()
    except NodeError as exc:
        if os.getuid() == 0:
            raise
        pytest.skip(f"user namespaces are unavailable to this uid, the sandbox refuses: {exc}")


def _workdir() -> Path:
    """Outside /tmp (the sandbox has a private /tmp, which would hide the attacks' targets by itself)."""
    return Path(tempfile.mkdtemp(prefix="prime-node-sandbox-test-", dir=OUTSIDE_TMP))


@pytest.fixture(scope="module")
def reports(sandbox_works: None) -> Iterator[dict[str, dict[str, Any]]]:
    workdir = _workdir()
    try:
        found = {"current_user": attack(workdir)}
        if os.getuid() == 0:
            found["unprivileged_user"] = _attack_as_unprivileged_user()
        yield found
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("who", ["current_user", "unprivileged_user"])
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_contained(reports: dict[str, dict[str, Any]], who: str, name: str) -> None:
    if who not in reports:
        pytest.skip("the test runs as an unprivileged user already: current_user covers it")
    report = reports[who]
    if who == "unprivileged_user":
        assert report["uid"] == UNPRIVILEGED
    entry = report[name]
    assert entry.get("error") is None, entry
    assert entry["started"], entry  # the program really ran: a sandbox that runs nothing blocks nothing
    assert entry["escaped"] is False, entry
    if name == "fill":
        wrote = {
            line.split()[1]: int(line.split()[2]) for line in entry["tail"].splitlines() if "WROTE" in line
        }
        assert set(wrote) == {"/dev/shm", "/tmp"}, entry
        assert all(count < FILL_MB for count in wrote.values()), entry  # bounded, not just private


def test_program_cannot_undo_read_only_mounts_or_see_the_host(sandbox_works: None) -> None:
    """Root of a nested user namespace still cannot remount the sandbox's binds writable."""
    prefix = str(Path(sys.base_prefix).resolve())
    source = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
assert sorted(p for p in os.listdir("/proc") if p.isdigit()) == ["1", str(os.getpid())], os.listdir("/proc")
assert libc.mount(None, {prefix!r}.encode(), None, 32 | 4096, None) != 0  # MS_REMOUNT|MS_BIND
assert libc.unshare(0x10000000 | 0x00020000) == 0  # a nested user + mount namespace: we are root there
open("/proc/self/uid_map", "w").write("0 1000 1")
assert libc.mount(None, {prefix!r}.encode(), None, 32 | 4096, None) != 0
for target in ({prefix!r} + "/escaped", "/escaped"):
    try:
        open(target, "w")
    except OSError:
        continue
    raise SystemExit("wrote " + target)
"""
    result = run_python(source, timeout_s=10)
    assert result.passed, result.stderr_tail


def test_the_users_data_dir_is_hidden_even_inside_the_python_install(
    sandbox_works: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data dir that lies inside a bound install (Python installed with prefix ~/.local) reads empty."""
    inside = Path(sys.base_prefix).resolve() / "include"
    if not inside.is_dir() or not any(inside.iterdir()):
        pytest.skip(f"{inside} is not a non-empty directory to stand in for the data dir")
    monkeypatch.setenv("PRIME_NODE_DATA_DIR", str(inside))
    assert str(inside) in hidden_inside(read_only_tree(sandbox_interpreter())[0])
    result = run_python(f"import os\nassert os.listdir({str(inside)!r}) == [], os.listdir({str(inside)!r})\n")
    assert result.passed, result.stderr_tail


def _refusal_in_namespace_without_userns() -> str:
    """In a child: enter a user namespace, forbid nested ones there (the sysctl is per namespace), then
    build a code task. Returns the child's report."""
    script = r"""
import ctypes, json, os, sys
uid, gid = os.geteuid(), os.getegid()
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000) != 0:
    print(json.dumps({"skip": "no user namespace to start from: " + os.strerror(ctypes.get_errno())}))
    raise SystemExit(0)
open("/proc/self/setgroups", "w").write("deny")
open("/proc/self/uid_map", "w").write(f"0 {uid} 1")
open("/proc/self/gid_map", "w").write(f"0 {gid} 1")
try:
    open("/proc/sys/user/max_user_namespaces", "w").write("0")
except OSError as exc:
    print(json.dumps({"skip": f"cannot lower user.max_user_namespaces in a user namespace here: {exc}"}))
    raise SystemExit(0)
from prime_node.errors import NodeError
from prime_node.tasks.code import CodeTask
try:
    CodeTask([("Write f().", "assert f() == 1")])
except NodeError as exc:
    print(json.dumps({"reason": exc.reason, "message": str(exc)}))
else:
    print(json.dumps({"reason": None}))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()[-1]


def test_code_task_refuses_clearly_where_user_namespaces_are_off() -> None:
    report = json.loads(_refusal_in_namespace_without_userns())
    if "skip" in report:
        pytest.skip(report["skip"])
    assert report["reason"] == "sandbox_unavailable", report
    assert "user.max_user_namespaces" in report["message"], report
    assert "unshare" in report["message"], report


if __name__ == "__main__":
    print(json.dumps(attack(Path(sys.argv[1]))))
