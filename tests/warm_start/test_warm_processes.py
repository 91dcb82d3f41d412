"""Warm-started prime-node processes, through a real warm-start server: each behaves as a fresh one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from prime_node.warm_start.launcher import WarmStart
from prime_node.warm_start.process import WarmProcess
from tests.warm_start.helpers import HANG_GUARD_S, gone, wait_for

CLI = [sys.executable, "-m", "prime_node"]
REPO = Path(__file__).resolve().parents[2]


def _start(warm: WarmStart, *args: str, **options: object) -> WarmProcess:
    process = warm.popen([*CLI, *args], **options)  # type: ignore[arg-type]
    assert process is not None, f"not warm-started; server log:\n{warm.log_path.read_text()}"
    return process


def test_a_warm_command_gets_the_callers_directory_environment_stdio_and_exit_code(
    warm: WarmStart, tmp_path: Path
) -> None:
    env = {**os.environ, "WALLET_PASSWORD": "correct horse"}
    process = _start(
        warm, "wallet", "new", "--keystore", "key.json", "--password-env", "WALLET_PASSWORD", "--light-kdf",
        "--json", cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == 0, err
    address = json.loads(out)["address"]
    assert (tmp_path / "key.json").exists()  # relative to the caller's directory, not the server's
    shown = _start(
        warm, "wallet", "show", "--keystore", str(tmp_path / "key.json"), "--password-env", "WALLET_PASSWORD",
        "--json", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = shown.communicate(timeout=HANG_GUARD_S)
    assert shown.returncode == 0 and json.loads(out)["address"] == address, err


def test_errors_keep_their_exit_codes_and_go_to_the_callers_stderr(warm: WarmStart, tmp_path: Path) -> None:
    usage = _start(warm, "wallet", "nonsense", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = usage.communicate(timeout=HANG_GUARD_S)
    assert usage.returncode == 2 and "No such command" in err and out == ""
    missing = tmp_path / "missing.json"
    failed = _start(
        warm, "wallet", "show", "--keystore", str(missing), "--no-password",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    out, _ = failed.communicate(timeout=HANG_GUARD_S)
    assert failed.returncode == 1 and out.startswith("error: ") and len(out.splitlines()) == 1, out


def test_a_running_warm_process_is_a_session_leader_that_signals_reach(
    warm: WarmStart, tmp_path: Path
) -> None:
    """`--password-file /dev/stdin` with nothing written keeps the command waiting on its stdin."""
    process = _start(
        warm, "wallet", "new", "--keystore", "k.json", "--password-file", "/dev/stdin", "--light-kdf",
        cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert os.getsid(process.pid) == process.pid and os.getpgid(process.pid) == process.pid
        assert os.readlink(f"/proc/{process.pid}/cwd") == str(tmp_path)
        assert process.poll() is None
        os.killpg(process.pid, signal.SIGTERM)  # as the demo's supervisor stops a child
        assert process.wait(timeout=HANG_GUARD_S) == -signal.SIGTERM
        assert not (tmp_path / "k.json").exists()
    finally:
        if process.poll() is None:
            process.kill()


def test_stopping_the_server_ends_every_child_it_forked(tmp_path: Path) -> None:
    server = WarmStart().start()
    try:
        process = _start(
            server, "wallet", "new", "--keystore", "k.json", "--password-file", "/dev/stdin",
            cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert process.poll() is None
    finally:
        server.close()
    assert process.wait(timeout=HANG_GUARD_S) == -signal.SIGKILL
    wait_for(lambda: gone(process.pid), "a child outlived its stopped server")


def test_a_hostile_or_broken_request_is_refused_and_the_server_keeps_serving(
    warm: WarmStart, tmp_path: Path
) -> None:
    for garbage in (b"\x00\x00", b"\xff\xff\xff\xff" + b"x" * 64, b"hello\n" * 100):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(str(warm.socket_path))
            raw.sendall(garbage)
            raw.shutdown(socket.SHUT_WR)
            raw.settimeout(HANG_GUARD_S)
            try:
                answer = raw.recv(100)
            except ConnectionResetError:  # closed with our bytes unread
                answer = b""
            assert answer == b""  # refused: closed without an answer
    process = _start(warm, "--version", stdout=subprocess.PIPE, text=True)
    out, _ = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == 0 and out.startswith("prime-node ")
    assert "request refused" in warm.log_path.read_text()


def test_another_import_time_environment_or_another_program_starts_cold(warm: WarmStart) -> None:
    assert warm.popen([*CLI, "--version"], env={**os.environ, "OMP_NUM_THREADS": "7"}) is None
    assert warm.popen([*CLI, "--version"], env={**os.environ, "PRIME_NODE_WARM_START": "0"}) is None
    assert warm.popen([sys.executable, "-c", "print(1)"]) is None


def test_the_children_of_a_sigkilled_owner_end_with_its_warm_start_server(tmp_path: Path) -> None:
    """The owner's death signal ends the server, and the server's ends its children (demo SIGKILLed)."""
    script = (
        "import subprocess, sys\n"
        "from prime_node.warm_start.launcher import WarmStart\n"
        "warm = WarmStart().start()\n"
        f"child = warm.popen({[*CLI]!r} + ['wallet', 'new', '--keystore', 'k.json', '--password-file',"
        " '/dev/stdin'], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(child.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        assert not gone(pid)
        owner.kill()
        owner.wait()
        wait_for(lambda: gone(pid), "a warm child outlived its SIGKILLed owner")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
