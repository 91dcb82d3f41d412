"""Process supervision with real subprocesses: whatever the demo started is gone after it stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from prime_node.demo.supervisor import Supervisor

REPO = Path(__file__).resolve().parents[2]

# A child that starts a grandchild in its own process group and reports both pids.
_PARENT_WITH_HELPER = """
import subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(helper.pid, flush=True)
time.sleep(600)
"""
_IGNORES_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """True once ``pid`` no longer exists (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_stop_all_ends_children_and_their_helpers(tmp_path: Path) -> None:
    supervisor = Supervisor(stop_deadline_s=5)
    with supervisor:
        children = [
            supervisor.start(f"c{i}", [sys.executable, "-c", _PARENT_WITH_HELPER], tmp_path / f"c{i}.log")
            for i in range(3)
        ]
        _wait_for(lambda: all(_lines(c.log_path) for c in children), 30, "helpers did not start")
        helpers = [int(_lines(c.log_path)[0]) for c in children]
        assert not any(_gone(pid) for pid in [*helpers, *(c.pid for c in children)])
        assert supervisor.exited() == []
    for child in children:
        assert child.process.returncode == -signal.SIGTERM
    _wait_for(lambda: all(_gone(pid) for pid in helpers), 5, "a helper survived its parent's stop")


def test_a_child_that_ignores_sigterm_is_killed_after_the_deadline(tmp_path: Path) -> None:
    supervisor = Supervisor(stop_deadline_s=1)
    child = supervisor.start("stubborn", [sys.executable, "-c", _IGNORES_SIGTERM], tmp_path / "s.log")
    _wait_for(lambda: bool(_lines(child.log_path)), 30, "child did not start")
    supervisor.stop_all()
    assert child.process.returncode == -signal.SIGKILL
    assert "ready" in child.log_tail()


def test_children_are_stopped_when_the_supervised_block_raises(tmp_path: Path) -> None:
    supervisor = Supervisor(stop_deadline_s=5)
    with pytest.raises(RuntimeError), supervisor:
        child = supervisor.start(
            "c", [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "c.log"
        )
        raise RuntimeError("boom")
    assert _gone(child.pid)


def test_an_exited_child_is_reported_with_its_log(tmp_path: Path) -> None:
    with Supervisor() as supervisor:
        child = supervisor.start(
            "bad", [sys.executable, "-c", "print('line one'); print('the reason'); raise SystemExit(3)"],
            tmp_path / "bad.log",
        )  # fmt: skip
        child.process.wait(timeout=30)
        assert supervisor.exited() == [child]
        assert child.log_tail(1) == "the reason"


def _children_of_demo(workdir: Path, count: int, demo: subprocess.Popen[str]) -> list[dict[str, object]]:
    """Wait until demo.json lists ``count`` children whose nodes all report running."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert demo.poll() is None, demo.communicate()[0]
        try:
            children = json.loads((workdir / "demo.json").read_text())["children"]
        except (OSError, ValueError, KeyError):
            children = []
        names = [str(child["name"]) for child in children]
        if len(children) == count and all(
            (workdir / "nodes" / name / "node.json").exists()
            and json.loads((workdir / "nodes" / name / "node.json").read_text())["state"] == "running"
            for name in names
        ):
            return list(children)
        time.sleep(0.5)
    raise AssertionError("the demo's nodes did not all come up")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    ("signum", "started_with_sigint_ignored"),
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["sigint", "sigterm", "sigint-as-a-background-job"],
)
def test_signalling_the_demo_stops_every_process_it_started(
    tmp_path: Path, tiny_model_dir: Path, signum: int, started_with_sigint_ignored: bool
) -> None:
    """The real orchestrator (stand-in nodes: plain joiners) as its own process, signalled like Ctrl-C.

    A shell without job control starts background commands with SIGINT ignored (and so does pytest's
    own process when it runs as one): the demo must stop on SIGINT all the same."""
    workdir = tmp_path / "demo"
    demo = subprocess.Popen(
        [sys.executable, "-m", "tests.demo.standin", str(workdir), str(tiny_model_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PRIME_NODE_DEMO_LOG_LEVEL": "warning"},
        preexec_fn=_ignore_sigint if started_with_sigint_ignored else None,  # noqa: PLW1509 (no threads)
    )
    pids: list[int] = []
    try:
        children = _children_of_demo(workdir, 5, demo)  # trainer, validator, 2 inferers, adversary
        pids = [int(str(child["pid"])) for child in children]
        assert not any(_gone(pid) for pid in pids)
        demo.send_signal(signum)
        output, _ = demo.communicate(timeout=80)  # hang guard: 10 x the supervisor's 8 s deadline
        assert demo.returncode == (130 if signum == signal.SIGINT else 143), output
        assert all(_gone(pid) for pid in pids), output
        for child in children:
            node_file = json.loads((workdir / "nodes" / str(child["name"]) / "node.json").read_text())
            # Each one shut down cleanly, before the supervisor's 8 s deadline: a SIGKILLed node never
            # writes "stopped". (How fast, in seconds, is the machine's business, not this test's.)
            assert node_file["state"] == "stopped"
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for pid in pids:
            if not _gone(pid):
                os.killpg(pid, signal.SIGKILL)


def test_children_end_even_when_the_demo_process_is_killed_outright(tmp_path: Path) -> None:
    """SIGKILL gives the demo no chance to clean up; the kernel's parent-death signal still ends children."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from prime_node.demo.supervisor import Supervisor\n"
        "supervisor = Supervisor()\n"
        "child = supervisor.start('c', [sys.executable, '-c', 'import time; time.sleep(600)'],"
        f" Path({str(tmp_path / 'c.log')!r}))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert not _gone(pid)
        parent.kill()
        parent.wait()
        _wait_for(lambda: _gone(pid), 5, "the child outlived its SIGKILLed parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
