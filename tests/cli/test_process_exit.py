"""A ``prime-node`` process ends without CPython's interpreter finalisation (issue 36: under heavy load the
demo's children outlived SIGTERM by more than 8 s and were SIGKILLed). Their nodes had stopped cleanly
(node.json "stopped") within the first seconds; the rest went to tearing torch's and transformers' modules
down one by one (faulthandler: "Garbage-collecting", ~2.5 CPU-s per process), during which the node's own
shutdown watchdog cannot fire. What a normal exit does that matters still happens: atexit handlers,
flushed output, the exit status.

The probe is a ``sitecustomize`` on PYTHONPATH: an object whose ``__del__`` runs only in finalisation, and
an atexit handler; each writes its line to a file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

SITE = """
import atexit, os

_PATH = os.environ["EXIT_PROBE"]


class _Finalised:
    def __del__(self, _open=open, _path=_PATH):
        with _open(_path, "a") as probe:
            probe.write("finalised\\n")


_sentinel = _Finalised()


def _at_exit():
    with open(_PATH, "a") as probe:
        probe.write("atexit\\n")


atexit.register(_at_exit)
"""


def _env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    probe = tmp_path / "probe.txt"
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "EXIT_PROBE": str(probe),
        "PRIME_NODE_LOG_LEVEL": "warning",
    }, probe


def _lines(probe: Path) -> list[str]:
    return probe.read_text().splitlines() if probe.exists() else []


def test_the_probe_sees_finalisation_in_a_plain_python_process(tmp_path: Path) -> None:
    env, probe = _env(tmp_path)
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True, timeout=60)
    assert _lines(probe) == ["atexit", "finalised"]


def test_a_node_stopped_by_sigterm_exits_without_finalisation(tmp_path: Path) -> None:
    env, probe = _env(tmp_path)
    data_dir = tmp_path / "node"
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "prime_node", "join", "--data-dir", str(data_dir)),
            *("--listen", "/ip4/127.0.0.1/tcp/0", "--run", "exittest", "--new-wallet", "--no-password"),
            "--light-kdf",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()  # the node's JSON line: it listens
        assert first.startswith("{"), process.communicate(timeout=120)[1]
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)  # hang guard only
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert "received SIGTERM, shutting down" in out  # written after the signal: flushed on the way out
    assert _lines(probe) == ["atexit"]


def test_an_error_keeps_its_status_and_its_line(tmp_path: Path) -> None:
    env, probe = _env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "prime_node", "run-trainer", "--config", str(tmp_path / "missing.toml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and done.stderr.strip()
    assert _lines(probe) == ["atexit"]
