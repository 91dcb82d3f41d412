"""A torchrun rank that starts warm: the process torchrun starts asks the warm-start server for the rank.

``python -m prime_node.warm_start.rank_stub [--cold-rank N ...] MODULE ARGS...`` is what torchrun runs
(``trainer_launcher.run_torchrun``, only when a warm-start server is named). The stub imports no torch: it
asks the server named in ``PRIME_NODE_WARM_START_SOCKET`` to fork ``python -m MODULE ARGS`` with its own
argv, environment (torchrun's RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*...), directory and
stdio, and stands in for that rank towards torchrun:

- signals torchrun sends (to the stub's process group) go on to the rank's process group;
- the stub dies with torchrun (a SIGKILL death signal), and the rank with the stub (the warm child
  watches the process that asked for it and SIGKILLs its group when that one is gone): so torchrun's
  SIGKILL of a rank's group, or torchrun's own death, ends the real rank too;
- the stub ends as the rank ended: its exit code, or death by the same signal, so torchrun sees the
  failure it would see from a cold rank.

When no server is named, warm starts are off, the rank is one of ``--cold-rank`` (global ``RANK``), or
the server answers "cold", the stub replaces itself (``os.execv``) with ``python -m MODULE ARGS`` under
the interpreter options it was started with: the rank then is the process a plain torchrun starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import NoReturn

from prime_node.parent_death import death_signal_setter
from prime_node.warm_start.launcher import WarmStart

STUB_MODULE = "prime_node.warm_start.rank_stub"
COLD_RANK_FLAG = "--cold-rank"
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
"""What torchrun (or anyone) may send a rank to stop it; SIGKILL reaches the rank through the stub's death."""


def stub_arguments(module: str, args: Sequence[str], cold_ranks: Sequence[int] = ()) -> list[str]:
    """The arguments after ``-m STUB_MODULE`` that run ``module args`` as a warm rank (``cold_ranks``:
    global ranks that must start cold)."""
    flags = [item for rank in cold_ranks for item in (COLD_RANK_FLAG, str(rank))]
    return [*flags, module, *args]


def parse(argv: Sequence[str]) -> tuple[set[int], str, list[str]]:
    """(cold ranks, module, its arguments); ValueError on a malformed command line."""
    cold: set[int] = set()
    rest = list(argv)
    while rest and rest[0] == COLD_RANK_FLAG:
        if len(rest) < 2:
            raise ValueError(f"{COLD_RANK_FLAG} needs a rank")
        cold.add(int(rest[1]))
        rest = rest[2:]
    if not rest or rest[0].startswith("-"):
        raise ValueError("usage: rank_stub [--cold-rank N ...] MODULE ARGS...")
    return cold, rest[0], rest[1:]


class _Forwarder:
    """Signals that arrive before the rank exists are kept, then sent; later ones go on at once."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.pid is None:
            self.pending.append(signum)
        else:
            _signal_group(self.pid, signum)

    def started(self, pid: int) -> None:
        self.pid = pid
        for signum in self.pending:
            _signal_group(pid, signum)
        self.pending.clear()


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def main(argv: Sequence[str]) -> NoReturn:
    try:
        cold_ranks, module, args = parse(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        os._exit(2)
    warm = WarmStart.attach()
    rank = os.environ.get("RANK", "")
    if warm is None or not rank.isdigit() or int(rank) in cold_ranks:  # a rank torchrun did not number
        _exec_cold(module, args)
    forwarder = _Forwarder()
    for signum in FORWARDED:
        signal.signal(signum, forwarder.handle)
    parent = os.getppid()
    set_death_signal = death_signal_setter(signal.SIGKILL)
    if set_death_signal is not None:
        set_death_signal()
        if os.getppid() != parent:  # torchrun died before the death signal was set
            os._exit(1)
    env = dict(os.environ)
    if "-u" in _interpreter_options():  # torchrun starts ranks with -u; a warm child honours the variable
        env["PYTHONUNBUFFERED"] = "1"
    process = warm.popen([sys.executable, "-m", module, *args], env=env, cwd=os.getcwd())
    if process is None:
        _exec_cold(module, args, pending=forwarder.pending)
    forwarder.started(process.pid)
    _exit_as(process.wait())


def _exec_cold(module: str, args: Sequence[str], pending: Sequence[int] = ()) -> NoReturn:
    """Become ``python [options] -m module args``: the rank a plain torchrun would have started."""
    clear_death_signal = death_signal_setter(0)
    if clear_death_signal is not None:
        clear_death_signal()
    for forwarded in FORWARDED:
        signal.signal(forwarded, signal.SIG_DFL)
    for signum in pending:  # a stop that came while the server was asked: it stops the rank unborn
        os.kill(os.getpid(), signum)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *_interpreter_options(), "-m", module, *args])


def _interpreter_options() -> list[str]:
    """The options this interpreter was started with, before ``-m STUB_MODULE`` (torchrun's ``-u``)."""
    return sys.orig_argv[1 : sys.orig_argv.index("-m")] if "-m" in sys.orig_argv else []


def _exit_as(returncode: int) -> NoReturn:
    """Exit with the rank's code, or die by the signal that ended it (as a shell reports a child)."""
    if returncode >= 0:
        os._exit(returncode & 0xFF)
    signum = -returncode
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)


if __name__ == "__main__":
    main(sys.argv[1:])
