"""Child processes of the demo: started in their own sessions, logged to files, always stopped.

Every child leads a new session (so its own children share its process group, and a Ctrl-C in the
terminal reaches only the demo, which then stops them in order). Stopping sends SIGTERM to each
process group, waits up to a deadline, then SIGKILLs whatever is left. On Linux each child also asks
the kernel for SIGTERM when the demo dies, so even a SIGKILLed demo leaves nothing running for long.

With ``warm_start`` the prime-node commands are forked from a warm-start server (prime_node/warm_start)
that imported torch, transformers and libp2p while the demo was setting up, instead of each importing
them again: the same processes (their own sessions, real pids), started in a fraction of the CPU time.
The server dies with the demo and takes its children with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from prime_node.parent_death import death_signal_setter
from prime_node.warm_start.launcher import WarmStart, enabled
from prime_node.warm_start.process import WarmProcess

STOP_DEADLINE_S = 8.0


@dataclass
class Child:
    """One started process: its name in the demo, command line and log file."""

    name: str
    argv: tuple[str, ...]
    log_path: Path
    process: subprocess.Popen[bytes] | WarmProcess

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the child's log (bounded read)."""
        try:
            with self.log_path.open("rb") as handle:
                handle.seek(0, os.SEEK_END)
                size = handle.tell()
                handle.seek(max(0, size - 64 * 1024))
                text = handle.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"(cannot read {self.log_path}: {exc.strerror})"
        return "\n".join(text.splitlines()[-lines:])


class Supervisor:
    """Starts children and guarantees they are gone when it is closed (also on any exception)."""

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        *,
        stop_deadline_s: float = STOP_DEADLINE_S,
        warm_start: bool = False,
    ):
        self._env = dict(os.environ if env is None else env)
        self._stop_deadline_s = stop_deadline_s
        self.children: list[Child] = []
        self._preexec = death_signal_setter(signal.SIGTERM)
        self._warm_start = warm_start and enabled(self._env)
        self._warm: WarmStart | None = None

    def start(self, name: str, argv: Sequence[str], log_path: Path) -> Child:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            process: subprocess.Popen[bytes] | WarmProcess | None = None
            if self._warm is not None:
                process = self._warm.popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self._env
                )
            if process is None:
                process = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._env,
                    start_new_session=True,
                    preexec_fn=self._preexec,  # noqa: PLW1509
                )
        child = Child(name, tuple(argv), log_path, process)
        self.children.append(child)
        return child

    def exited(self) -> list[Child]:
        """Children that have ended (a demo child ending before the demo does is a failure)."""
        return [child for child in self.children if not child.running()]

    def pids(self) -> dict[str, int]:
        return {child.name: child.pid for child in self.children}

    def stop_all(self) -> None:
        """SIGTERM every child's process group, wait up to the deadline, SIGKILL the rest, reap all.

        A second Ctrl-C while this runs is held back until every child is gone, then delivered."""
        stop_signals = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        held = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        try:
            self._stop_all()
            if self._warm is not None:
                self._warm.close()
                self._warm = None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def _stop_all(self) -> None:
        for child in self.children:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + self._stop_deadline_s
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        for child in self.children:
            # Also after the leader exited: helpers it started (e.g. an inference child) share its group.
            _signal_group(child, signal.SIGKILL)
            if child.running():
                child.process.wait()

    def __enter__(self) -> Supervisor:
        """Inside the block children may be warm-started: the server starts importing now, while the
        caller prepares what the children need."""
        if self._warm_start and self._warm is None:
            self._warm = WarmStart(self._env).start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop_all()


def _signal_group(child: Child, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signum)
