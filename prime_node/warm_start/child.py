"""Turn a freshly forked warm-start child into the process its owner asked for.

Everything a fresh ``python -m prime_node ...`` would have that the server's state does not give: its
own session and process group (the owner signals the group, as the demo's supervisor does), the
owner's stdio, directory, environment, argv and import path; Python's default signal handlers and
standard streams built for the new descriptors (line-buffered on a terminal, unbuffered under
PYTHONUNBUFFERED); fresh randomness where a library would otherwise share the server's; and death
with the server and with the process that asked for it (its owner: a process started with plain
``subprocess.Popen`` would be in the owner's process group and go with it), so that nothing is left
running unowned.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import select
import signal
import sys
import threading
import traceback
from collections.abc import Callable

from prime_node.parent_death import death_signal_setter
from prime_node.warm_start.wire import Request

_RESET_TO_DEFAULT = (
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGCHLD,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
)


def become(request: Request, server_pid: int, owner_pid: int) -> None:
    """Called in the child right after the fork, before any of the command's code runs."""
    os.setsid()
    _die_with(owner_pid)
    set_death_signal = death_signal_setter(signal.SIGKILL)
    if set_death_signal is not None:
        set_death_signal()
        if os.getppid() != server_pid:  # the server died between the fork and the call above
            os._exit(1)
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target, inheritable=True)
    for fd in set(request.fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    sys.argv = list(request.argv)
    sys.path[:] = list(request.sys_path)
    _default_signals()
    _fresh_streams(unbuffered=bool(request.env.get("PYTHONUNBUFFERED")))
    _fresh_randomness()


def _die_with(owner_pid: int) -> None:
    """SIGKILL this child's process group when the owner ends (a pidfd, watched by a daemon thread)."""
    try:
        owner = os.pidfd_open(owner_pid)
    except (ProcessLookupError, OSError):
        os._exit(1)

    def watch() -> None:
        select.select([owner], [], [])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="warm-start owner watch", daemon=True).start()


def _default_signals() -> None:
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as CPython sets it at start
    for signum in _RESET_TO_DEFAULT:
        signal.signal(signum, signal.SIG_DFL)


def _fresh_streams(*, unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr on descriptors 0-2 with the buffering CPython would choose for them."""
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = _text_writer(1, unbuffered=unbuffered, errors="strict")
    sys.stderr = _text_writer(2, unbuffered=unbuffered, errors="backslashreplace")


def _text_writer(fd: int, *, unbuffered: bool, errors: str) -> io.TextIOWrapper:
    interactive = os.isatty(fd)
    raw = io.FileIO(fd, "w", closefd=False)
    binary: io.RawIOBase | io.BufferedWriter = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        binary,  # type: ignore[arg-type]
        encoding="utf-8",
        errors=errors,
        line_buffering=interactive or fd == 2,
        write_through=unbuffered,
    )


def _fresh_randomness() -> None:
    """``random`` reseeds itself at fork; numpy's global generator does not, so every child would draw
    the same numbers. torch's default generator starts from a fixed seed in a fresh process too, so
    it is left as the server left it (untouched)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def run_as_process(command: Callable[[], object]) -> None:
    """Run the command and end the process as CPython would (exit code, an uncaught Ctrl-C ending by
    SIGINT, non-daemon threads joined, atexit run, streams flushed), but without tearing the preloaded
    modules down one by one: that finalisation takes seconds with torch loaded and is skipped by
    ``os._exit``."""
    code = 0
    try:
        command()
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    _finish()
    os._exit(code)


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _finish() -> None:
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
