"""The rank stub (prime_node/warm_start/rank_stub.py): what torchrun starts stands in for a rank forked warm.

Its rank is really warm (a child of the warm-start server, not of the stub); signals to the stub reach
the rank; the stub ends as the rank ended (exit code, or the same signal); the stub's death ends the
rank; and without a server (or for a --cold-rank) it becomes the plain ``python -m MODULE`` in place.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from prime_node.errors import NodeError
from prime_node.roles.trainer_launcher import run_torchrun
from prime_node.warm_start.compatibility import cold_reason
from prime_node.warm_start.launcher import DISABLE_VARIABLE, SOCKET_VARIABLE, WarmStart
from prime_node.warm_start.rank_stub import STUB_MODULE, parse, stub_arguments
from tests.warm_start.helpers import HANG_GUARD_S, gone, wait_for

REPO = Path(__file__).resolve().parents[2]
STUB = [sys.executable, "-m", STUB_MODULE]


def _server_pid(warm: WarmStart) -> int:
    assert warm._server is not None
    return warm._server.pid


def _forked(warm: WarmStart) -> set[int]:
    """The server's children now. (A warm child's /proc environ and cmdline are the server's: they are
    the memory the server was started with, so the stub's rank is told apart as the one new child.)"""
    return {child.pid for child in psutil.Process(_server_pid(warm)).children()}


def _rank_of(warm: WarmStart, stub: subprocess.Popen[str], before: set[int]) -> psutil.Process:
    """The stub's warm rank, once the server has forked it."""
    found: list[int] = []

    def forked() -> bool:
        assert stub.poll() is None, stub.communicate()
        found[:] = _forked(warm) - before
        return bool(found)

    wait_for(forked, "no warm rank")
    assert len(found) == 1, found
    return psutil.Process(found[0])


def _stub(
    warm: WarmStart | None, *args: str, cold_ranks: tuple[int, ...] = (), env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], set[int]]:
    """A stub running ``prime-node ARGS`` (a prompt waiting on stdin keeps it running), as torchrun
    would start it: its own session, RANK in its environment."""
    before = _forked(warm) if warm is not None else set()
    environment = {**os.environ, "RANK": "1", **(env or {})}
    environment.pop("PRIME_NODE_WARM_START_SOCKET", None)
    if warm is not None:
        environment = warm.child_env(environment)
    process = subprocess.Popen(
        [*STUB, *stub_arguments("prime_node", args, cold_ranks)],
        cwd=REPO,
        env=environment,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return process, before


def _waiting(tmp_path: Path) -> tuple[str, ...]:
    """A command that reads its password from a FIFO nobody writes: a rank that runs until stopped."""
    fifo = tmp_path / "password"
    os.mkfifo(fifo)
    return (
        "wallet",
        "new",
        "--keystore",
        str(tmp_path / "k.json"),
        "--light-kdf",
        "--password-file",
        str(fifo),
    )


def test_the_stubs_rank_is_forked_by_the_server_and_gets_the_stubs_signals_and_ends_it_alike(
    warm: WarmStart, tmp_path: Path
) -> None:
    process, before = _stub(warm, *_waiting(tmp_path))
    try:
        rank = _rank_of(warm, process, before)
        assert rank.ppid() == _server_pid(warm) != process.pid  # forked warm, not started by the stub
        assert process.poll() is None
        os.killpg(process.pid, signal.SIGTERM)  # as torchrun stops a rank (its process group)
        process.wait(timeout=HANG_GUARD_S)
        assert process.returncode == -signal.SIGTERM  # the rank died of it, and so did the stub
        wait_for(lambda: gone(rank.pid), "the rank outlived its stub")
    finally:
        process.kill()
        process.communicate()


def test_the_stub_exits_with_the_ranks_exit_code(warm: WarmStart, tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    process, _ = _stub(warm, "wallet", "show", "--keystore", str(missing))
    _, err = process.communicate(timeout=HANG_GUARD_S)
    plain = subprocess.run(
        [sys.executable, "-m", "prime_node", "wallet", "show", "--keystore", str(missing)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )
    assert plain.returncode not in (0, None)
    assert process.returncode == plain.returncode, err
    assert err.strip() == plain.stderr.strip()  # the rank had the stub's stderr


def test_a_sigkilled_stub_takes_its_warm_rank_with_it(warm: WarmStart, tmp_path: Path) -> None:
    """torchrun's last word to a rank that does not stop is SIGKILL to its group (the stub's)."""
    process, before = _stub(warm, *_waiting(tmp_path))
    try:
        rank = _rank_of(warm, process, before)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=HANG_GUARD_S)
        assert process.returncode == -signal.SIGKILL
        wait_for(lambda: gone(rank.pid), "the warm rank outlived its SIGKILLed stub")
    finally:
        process.kill()
        process.communicate()


@pytest.mark.parametrize("how", ["no server", "warm starts off", "a cold rank", "a startup hook"])
def test_without_a_warm_start_the_stub_becomes_the_plain_command_in_place(
    warm: WarmStart, tmp_path: Path, how: str
) -> None:
    """The last case: a sitecustomize on the rank's PYTHONPATH (benchmarks/scale.py's probe) runs only in
    a fresh interpreter, so the server answers "cold" and the stub execs, and the hook runs."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(f"open({str(tmp_path / 'hook-ran')!r}, 'w').close()\n")
    env = {DISABLE_VARIABLE: "0"} if how == "warm starts off" else {}
    if how == "a startup hook":
        env["PYTHONPATH"] = str(hooks)
    process, before = _stub(
        None if how == "no server" else warm,
        *_waiting(tmp_path),
        cold_ranks=(1,) if how == "a cold rank" else (),  # RANK is 1
        env=env,
    )
    try:

        def exec_done() -> bool:
            return "-m prime_node wallet" in " ".join(psutil.Process(process.pid).cmdline())

        wait_for(exec_done, "the stub did not exec the command")
        assert not _forked(warm) - before
        if how == "a startup hook":
            wait_for((tmp_path / "hook-ran").exists, "the startup hook did not run")
        else:
            assert not (tmp_path / "hook-ran").exists()
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=HANG_GUARD_S)
        assert process.returncode == -signal.SIGTERM
    finally:
        process.kill()
        process.communicate()


def test_the_stubs_command_line() -> None:
    assert parse(stub_arguments("m.n", ["--x", "1"], [0, 3])) == ({0, 3}, "m.n", ["--x", "1"])
    assert parse(["m.n"]) == (set(), "m.n", [])
    for bad in ([], ["--cold-rank"], ["--cold-rank", "x", "m"], ["--other", "m"]):
        with pytest.raises(ValueError):
            parse(bad)


def test_torchruns_variables_and_torchs_own_cache_directory_do_not_make_a_rank_cold() -> None:
    """What torchrun adds to a rank's environment is read when torch.distributed is used, not at import;
    TORCHINDUCTOR_CACHE_DIR, which torch writes into the environment of a process that imported
    torch._dynamo (a test process, a launcher), is read at that module's import: it counts only when the
    server has imported it."""
    base = {"OMP_NUM_THREADS": "1", "HOME": "/root"}
    rank = {
        **base,
        "RANK": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_ERROR_FILE": "/tmp/x/error.json",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    }
    assert cold_reason(base, "/py", rank, "/py") is None
    cache = {**base, "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root"}
    assert cold_reason(base, "/py", cache, "/py", {"torch"}) is None
    assert "TORCHINDUCTOR_CACHE_DIR" in (
        cold_reason(base, "/py", cache, "/py", {"torch._dynamo.package"}) or ""
    )
    assert "TORCH_LOGS" in (cold_reason(base, "/py", {**rank, "TORCH_LOGS": "+dynamo"}, "/py") or "")


def test_torchrun_fails_as_before_when_its_warm_ranks_fail(
    warm: WarmStart, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The launcher's torchrun with warm ranks that exit 1 (a run config that is not there): torchrun
    reports each rank's exit code and fails; the launcher says a rank failed."""
    monkeypatch.setenv(SOCKET_VARIABLE, str(warm.socket_path))
    monkeypatch.delenv(DISABLE_VARIABLE, raising=False)
    missing = tmp_path / "missing.toml"
    with pytest.raises(NodeError, match="a trainer rank failed") as failed:
        run_torchrun("prime_node.ml.dist_entry", ["--config", str(missing)], 2)
    assert failed.value.reason == "trainer_failed"
    err = capfd.readouterr().err
    # the first rank to fail gets torchrun to stop the other, which may not have said it yet
    assert f"error: cannot read run config {missing}" in err, err[-3000:]
    assert "rank_stub" in err and "exitcode  : 1" in err  # torchrun ran the stubs, and saw their code
