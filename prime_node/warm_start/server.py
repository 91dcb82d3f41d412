"""The warm-start server: import the heavy libraries once, then fork one ready child per request.

Run as ``python -m prime_node.warm_start.server SOCKET`` by its owner (``launcher.py``). It binds the
socket first (so requests can queue while it imports), imports ``PRELOAD``, and then serves: each
request is checked (same user, same Python, same import-time environment, and this process still has a
single thread, since forking a multi-threaded process is unsafe), forked, and answered with the child's
pid; when the child ends its exit status is sent and the connection closed. On SIGTERM (its owner
asks it to stop, or the owner died: the server has a death signal) it SIGKILLs every child's process
group, reaps them, and exits. Serving is single-threaded with a selector over the listener, a signal
wake-up pipe and one pidfd per running child.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import threading
from dataclasses import dataclass, field

from prime_node.warm_start.child import become, run_as_process
from prime_node.warm_start.compatibility import ENTRY_MODULES, cold_reason, startup_hook_reason
from prime_node.warm_start.wire import Request, WarmStartError, receive_request, reply_line

log = logging.getLogger(__name__)

PRELOAD = (
    "numpy",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors.torch",
    "trio",
    "libp2p",
    "prime_node.cli.main",
    "prime_node.ml.model",
    "prime_node.ml.engine",
    "prime_node.p2p.libp2p_host",
)
"""What every node imports; a module that fails to import is logged and skipped (the child then
imports it as a fresh process would, and says the same error)."""

REQUEST_READ_TIMEOUT_S = 10.0
READY_WAIT_S = 30.0
"""How long the server waits for a new child to finish becoming its process (its own session, the
caller's stdio) before it answers with the pid: so that the owner can signal the group at once."""
_CREDENTIALS = struct.Struct("3i")


@dataclass(frozen=True)
class Forked:
    """What a forked child takes out of the serving loop: its request, and where to say it is ready."""

    request: Request
    server_pid: int
    owner_pid: int
    ready_fd: int


@dataclass
class _Running:
    pid: int
    pidfd: int
    connection: socket.socket


@dataclass
class _State:
    listener: socket.socket
    wakeup_read: int
    running: dict[int, _Running] = field(default_factory=dict)

    def leave(self) -> None:
        """In a forked child: close everything of the server's (sockets through their objects, so that
        no later garbage collection closes a descriptor number the child has reused)."""
        self.listener.close()
        os.close(self.wakeup_read)
        for child in self.running.values():
            child.connection.close()
            os.close(child.pidfd)
        self.running.clear()


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            log.warning("warm start: %s not preloaded: %s", name, exc)


def thread_count() -> int:
    """Native threads of this process (Python's count where /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def fork_unsafe_reason(threads_after_preload: int) -> str | None:
    """Why forking now would be unsafe. Threads that libraries start at import and that survive a fork
    by their own ``pthread_atfork`` handlers (numpy's OpenBLAS pool) are counted once, after the
    preload; any Python thread, or any native thread started since, makes a fork unsafe."""
    if threading.active_count() != 1:
        return f"the server runs {threading.active_count()} Python threads"
    if thread_count() > threads_after_preload:
        return f"the server has {thread_count()} threads, {threads_after_preload} after its imports"
    return None


def serve(listener: socket.socket, threads_after_preload: int) -> Forked | None:
    """Serve until stopped (None), or return (request, server pid) in a forked child."""
    server_pid = os.getpid()
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    stopping: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda number, _frame: stopping.append(number))
    state = _State(listener, wakeup_read)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wakeup_read, selectors.EVENT_READ, "wakeup")
    while not stopping:
        for key, _events in selector.select():
            if key.data == "accept":
                forked = _accept(state, selector, server_pid, threads_after_preload)
                if forked is not None:
                    selector.close()
                    os.close(wakeup_write)
                    state.leave()
                    return forked
            elif key.data == "wakeup":
                with contextlib.suppress(BlockingIOError):
                    os.read(wakeup_read, 512)
            else:
                _reap(state, selector, key.data)
    _stop_children(state)
    return None


def _accept(
    state: _State, selector: selectors.BaseSelector, server_pid: int, threads_after_preload: int
) -> Forked | None:
    try:
        connection, _ = state.listener.accept()
    except OSError:
        return None
    try:
        connection.settimeout(REQUEST_READ_TIMEOUT_S)
        owner_pid, uid = _peer(connection)
        if uid != os.getuid():
            raise WarmStartError(f"warm-start request from uid {uid}")
        request = receive_request(connection)
    except (OSError, WarmStartError) as exc:
        log.warning("warm start: request refused: %s", exc)
        connection.close()
        return None
    reason = cold_reason(os.environ, sys.executable, request.env, request.executable, sys.modules)
    if reason is None:
        reason = startup_hook_reason(request.sys_path, sys.path, os.path.exists)
    if request.module not in ENTRY_MODULES:
        reason = f"{request.module} is not a prime-node entry point"
    if reason is None:
        reason = fork_unsafe_reason(threads_after_preload)
    if reason is None:
        reason = namespace_reason(owner_pid)
    if reason is not None:
        _close_fds(request.fds)
        with contextlib.suppress(OSError):
            connection.sendall(reply_line("cold", reason))
        connection.close()
        return None
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        connection.close()
        os.close(ready_read)
        return Forked(request, server_pid, owner_pid, ready_write)
    os.close(ready_write)
    _close_fds(request.fds)
    _wait_until_ready(ready_read)
    pidfd = os.pidfd_open(pid)
    try:
        connection.sendall(reply_line("pid", pid))
    except OSError:  # the owner gave up waiting: nobody would ever stop this child
        _kill_group(pid)
    state.running[pidfd] = _Running(pid, pidfd, connection)
    selector.register(pidfd, selectors.EVENT_READ, pidfd)
    return None


def _wait_until_ready(ready_read: int) -> None:
    """Until the child wrote its byte or closed the pipe (it died), at most ``READY_WAIT_S``."""
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(ready_read, selectors.EVENT_READ)
            if selector.select(READY_WAIT_S):
                os.read(ready_read, 1)
    finally:
        os.close(ready_read)


def _reap(state: _State, selector: selectors.BaseSelector, pidfd: int) -> None:
    child = state.running.pop(pidfd)
    selector.unregister(pidfd)
    _, status = os.waitpid(child.pid, 0)
    with contextlib.suppress(OSError):
        child.connection.sendall(reply_line("exit", os.waitstatus_to_exitcode(status)))
    child.connection.close()
    os.close(pidfd)


def _stop_children(state: _State) -> None:
    for child in state.running.values():
        _kill_group(child.pid)
    for child in state.running.values():
        _, status = os.waitpid(child.pid, 0)
        with contextlib.suppress(OSError):
            child.connection.sendall(reply_line("exit", os.waitstatus_to_exitcode(status)))
        child.connection.close()
        os.close(child.pidfd)
    state.running.clear()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


NAMESPACES = ("net", "mnt")
"""A child lives in the server's namespaces, whoever asked: a requester in another network namespace
(``ip netns exec``: the NAT and multi-node tests, torchrun ranks of a node in one) must start cold, or its
process would listen and dial in the wrong network."""


def namespace_reason(pid: int) -> str | None:
    """Why a process of ``pid`` cannot be served warm for its namespaces, or None."""
    for name in NAMESPACES:
        try:
            theirs, ours = os.stat(f"/proc/{pid}/ns/{name}"), os.stat(f"/proc/self/ns/{name}")
        except OSError as exc:
            return f"its {name} namespace cannot be read ({exc.strerror})"
        if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
            return f"it runs in another {name} namespace"
    return None


def _peer(connection: socket.socket) -> tuple[int, int]:
    """The connecting process's pid and uid, as the kernel saw them (SO_PEERCRED)."""
    raw = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    pid, uid, _gid = _CREDENTIALS.unpack(raw)
    return int(pid), int(uid)


def _close_fds(fds: tuple[int, ...]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _own_log_handler() -> logging.Handler:
    """The server logs through a handler of its own logger only: the root logger stays unconfigured,
    so that a child's ``logging.basicConfig`` (the CLI's ``--log-level``) takes effect as in a fresh
    process."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    return handler


def main(socket_path: str) -> None:
    handler = _own_log_handler()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    preload()
    gc.freeze()  # what the imports made is never collected: children's collections do not touch its pages
    forked = serve(listener, thread_count())
    if forked is None:
        return
    log.removeHandler(handler)
    log.propagate = True
    log.setLevel(logging.NOTSET)
    become(forked.request, forked.server_pid, forked.owner_pid)
    os.write(forked.ready_fd, b"1")
    os.close(forked.ready_fd)
    module = forked.request.module  # run as `python -m MODULE` runs it: prime_node/__main__.py is the CLI
    run_as_process(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))


if __name__ == "__main__":
    main(sys.argv[1])
