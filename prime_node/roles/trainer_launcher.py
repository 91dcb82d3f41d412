"""The launcher of the networked trainer under torchrun (``run-trainer --nproc N`` without ``--local``).

The launcher (the ``run-trainer`` process) does everything that can fail before a process starts (run
config, node flags, keystore and password, the trainer-key check), writes the checked configs to a
private directory, runs torchrun (``--standalone``) in a session of its own, and hands the unlocked key
to rank 0 alone over a Unix socket in that directory: never on disk, in an environment variable or on a
command line, and only to a process whose parent is the torchrun it started. A failed rank ends torchrun
with a non-zero status, which becomes NodeError ``trainer_failed``; SIGINT/SIGTERM/SIGHUP to the launcher
become SIGTERM to torchrun, which stops every rank (a second signal SIGKILLs torchrun, and its ranks
follow through their parent-death signal). What each rank then runs is ``trainer_ranks.py``'s.

Across machines (``--nnodes``/``--node-rank``/``--rdzv-endpoint``): every machine runs the same launcher
with its node rank; torchrun's static rendezvous makes node 0's rank 0 global rank 0, so the node, its
key and its network stay on node 0, whose launcher alone checks and hands over the key. The other
launchers need no keystore: their ranks only train.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from prime_node.errors import NodeError
from prime_node.parent_death import death_signal_setter
from prime_node.roles.rendezvous import (
    SINGLE_NODE,
    Rendezvous,
    gloo_interface,
    torchrun_command,
    torchrun_env,
)
from prime_node.warm_start.launcher import WarmStart
from prime_node.warm_start.rank_stub import STUB_MODULE, stub_arguments

if TYPE_CHECKING:
    from crypto.keys import WalletKey
    from prime_node.config import RunConfig
    from prime_node.node_config import NodeConfig

log = logging.getLogger(__name__)
ENTRY_MODULE = "prime_node.roles.trainer_ranks"
SPEC_FILE = "launch.json"
KEY_SOCKET = "key.sock"
KEY_WAIT_S = 60.0
"""How long rank 0 waits for the launcher to answer with the key."""


# -- what the launcher hands every rank -------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchSpec:
    """The checked configs every rank starts from (no secret: the key travels over the socket)."""

    run: RunConfig
    node: NodeConfig
    dataplane_host: str
    dataplane_port: int
    exit_when_done: bool

    def write(self, directory: Path) -> None:
        document = {
            "run": json.loads(self.run.model_dump_json()),
            "node": json.loads(self.node.model_dump_json()),
            "dataplane_host": self.dataplane_host,
            "dataplane_port": self.dataplane_port,
            "exit_when_done": self.exit_when_done,
        }
        (directory / SPEC_FILE).write_text(json.dumps(document), encoding="utf-8")

    @classmethod
    def read(cls, directory: Path) -> LaunchSpec:
        from prime_node.config import RunConfig
        from prime_node.node_config import NodeConfig

        document = json.loads((directory / SPEC_FILE).read_text(encoding="utf-8"))
        return cls(
            run=RunConfig.model_validate(document["run"]),
            node=NodeConfig.model_validate(document["node"]),
            dataplane_host=str(document["dataplane_host"]),
            dataplane_port=int(document["dataplane_port"]),
            exit_when_done=bool(document["exit_when_done"]),
        )


# -- the key: launcher -> rank 0 ----------------------------------------------------------------------------


class KeyHandoff:
    """Serves the unlocked key once, over a Unix socket in ``directory`` (mode 0700), to the first
    process that connects as the launcher's own user and is a child of ``parent`` (the torchrun agent,
    set with ``serve``; its ranks are its direct children). Anyone else is hung up on; after the
    hand-over the socket is closed."""

    def __init__(self, directory: Path, key: WalletKey) -> None:
        if not hasattr(socket, "SO_PEERCRED"):
            raise NodeError(
                "the networked trainer with --nproc > 1 needs Linux (it checks who asks for the key)",
                reason="bad_config",
            )
        self._secret = key.secret
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(str(directory / KEY_SOCKET))
            self._listener.listen(4)
        except OSError as exc:  # e.g. a $TMPDIR too long for a socket path
            self._listener.close()
            raise NodeError(
                f"cannot open the key socket in {directory}: {exc}", reason="bad_config"
            ) from None
        self._listener.settimeout(0.25)
        self._closed = threading.Event()
        self.handed = threading.Event()
        self._thread: threading.Thread | None = None

    def serve(self, parent: int) -> None:
        self._thread = threading.Thread(target=self._serve, args=(parent,), name="key-handoff", daemon=True)
        self._thread.start()

    def _serve(self, parent: int) -> None:
        while not self._closed.is_set() and not self.handed.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with connection:
                pid, uid, _gid = struct.unpack(
                    "3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                )
                if uid != os.getuid() or _parent_of(pid) != parent:
                    log.warning("refused the trainer key to process %d (not a rank of this torchrun)", pid)
                    continue
                with contextlib.suppress(OSError):
                    connection.sendall(self._secret)
                    self.handed.set()
        self._listener.close()  # handed once: nobody else may even connect

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._listener.close()


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state, then ppid


def receive_key(directory: Path, *, timeout: float = KEY_WAIT_S) -> WalletKey:
    """Rank 0: the trainer key from the launcher (NodeError ``no_key`` if it does not come)."""
    from crypto.errors import CryptoError
    from crypto.keys import SECRET_SIZE, WalletKey

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(timeout)
        data = b""
        try:
            client.connect(str(directory / KEY_SOCKET))
            while len(data) < SECRET_SIZE and (chunk := client.recv(SECRET_SIZE - len(data))):
                data += chunk
        except OSError as exc:
            raise NodeError(
                f"rank 0 could not get the trainer key from the launcher: {exc}", reason="no_key"
            ) from None
    try:
        return WalletKey(data)
    except CryptoError:
        raise NodeError("the launcher sent no usable trainer key", reason="no_key") from None


# -- torchrun --------------------------------------------------------------------------------------------


def run_torchrun(
    module: str,
    args: Sequence[str],
    nproc: int,
    *,
    rendezvous: Rendezvous = SINGLE_NODE,
    on_started: Callable[[int], None] | None = None,
    cold_ranks: Sequence[int] = (),
) -> None:
    """Run ``module`` on ``nproc`` ranks of this node under torchrun and wait for it.

    When a warm-start server is named (``PRIME_NODE_WARM_START_SOCKET``: the suite, the demo), each rank
    but the global ranks in ``cold_ranks`` is forked ready from it (``warm_start/rank_stub.py``: torchrun
    starts a stub that stands in for the rank); otherwise torchrun starts ``module`` itself.

    NodeError ``trainer_failed`` if torchrun exits non-zero (a rank failed; torchrun has stopped the
    others and printed which). SIGINT/SIGTERM/SIGHUP while it runs are forwarded as SIGTERM (torchrun
    then stops every rank), a second one SIGKILLs torchrun's whole process group; either way this
    raises KeyboardInterrupt once torchrun is gone. ``on_started`` gets torchrun's pid.
    """
    interface = gloo_interface(rendezvous)
    if rendezvous.multi_node:
        print(
            f"node {rendezvous.node_rank} of {rendezvous.nnodes}: meeting at {rendezvous.endpoint}, "
            f"gloo on {interface}",
            file=sys.stderr,
            flush=True,
        )
    env = torchrun_env(interface)
    if WarmStart.attach(env) is not None:
        module, args = STUB_MODULE, stub_arguments(module, args, cold_ranks)
    stops = _StopForwarder()
    with stops.installed():
        process = subprocess.Popen(
            torchrun_command(module, args, nproc, rendezvous),
            env=env,
            start_new_session=True,  # terminal signals reach the launcher only; it decides what ranks get
            preexec_fn=death_signal_setter(signal.SIGTERM),  # noqa: PLW1509 (a dying launcher stops it)
        )
        try:
            stops.forward_to(process.pid)
            if on_started is not None:
                on_started(process.pid)
            code = process.wait()
        except BaseException:
            _kill_group(process)
            raise
    if stops.received:
        raise KeyboardInterrupt(signal.Signals(stops.received[0]).name)
    if code < 0:
        raise NodeError(
            f"torchrun was killed (signal {-code}): this node's trainer ranks are gone",
            reason="trainer_failed",
        )
    if code != 0:
        raise NodeError(
            f"torchrun exited with status {code}: a trainer rank failed (its error is above)",
            reason="trainer_failed",
        )


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _StopForwarder:
    """The launcher's SIGINT/SIGTERM/SIGHUP handler: the first one becomes SIGTERM to torchrun (which
    stops every rank), a second SIGKILLs torchrun's process group. Installed before torchrun starts; a
    signal that comes before its pid is known is forwarded as soon as it is."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._pid: int | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def forward_to(self, pid: int) -> None:
        self._pid = pid
        for count in range(1, len(self.received) + 1):
            self._send(count)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if len(self.received) == 1:
            print(f"received {signal.Signals(signum).name}, stopping every trainer rank", file=sys.stderr)
        self._send(len(self.received))

    def _send(self, count: int) -> None:
        if self._pid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if count == 1:
                os.kill(self._pid, signal.SIGTERM)
            else:
                os.killpg(self._pid, signal.SIGKILL)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def launch_networked(
    spec: LaunchSpec,
    key: WalletKey | None,
    nproc: int,
    gpus: str = "auto",
    rendezvous: Rendezvous = SINGLE_NODE,
) -> None:
    """The launcher of ``run-trainer --nproc N`` without --local (see the module doc); ``gpus`` is
    ``--gpu``, which every rank maps to its device (``hardware.select_device``). ``key`` is None on
    nodes other than node 0: none of their ranks is rank 0, the only one that signs."""
    if (key is None) != (rendezvous.node_rank > 0):
        raise NodeError("the trainer key goes to node 0 only, and node 0 needs it", reason="bad_config")
    directory = Path(tempfile.mkdtemp(prefix="prime-node-trainer-"))  # mode 0700
    try:
        spec.write(directory)
        args = ["--launch-dir", str(directory), "--gpu", gpus]
        if key is None:
            run_torchrun(ENTRY_MODULE, args, nproc, rendezvous=rendezvous)
            return
        handoff = KeyHandoff(directory, key)
        try:
            # Rank 0 takes the key, which goes only to a child of this torchrun: it starts cold.
            run_torchrun(
                ENTRY_MODULE, args, nproc, rendezvous=rendezvous, on_started=handoff.serve, cold_ranks=(0,)
            )
        finally:
            handoff.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
