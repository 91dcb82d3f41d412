"""The networked trainer under torchrun (``run-trainer --nproc N`` without ``--local``; DESIGN §6, §8).

Rank 0 is the whole node, exactly as with one process: libp2p host, gossip, admission, weight swarm,
status API and the trainer key. Ranks > 0 hold no network and no key: they build the same
``TrainingSession`` and ``follow`` it; every admitted step's batch reaches them inside rank 0's
``session.train`` and they take the step with it, until rank 0's ``session.close`` stops them.

The launcher (the ``run-trainer`` process) does everything that can fail before a process starts (run
config, node flags, keystore and password, the trainer-key check), writes the checked configs to a
private directory, runs torchrun (``--standalone``) in a session of its own, and hands the unlocked key
to rank 0 alone over a Unix socket in that directory: never on disk, in an environment variable or on a
command line, and only to a process whose parent is the torchrun it started. A failed rank ends torchrun
with a non-zero status, which becomes NodeError ``trainer_failed``; SIGINT/SIGTERM/SIGHUP to the launcher
become SIGTERM to torchrun, which stops every rank (a second signal SIGKILLs torchrun, and its ranks
follow through their parent-death signal).

Across machines (``--nnodes``/``--node-rank``/``--rdzv-endpoint``): every machine runs the same launcher
with its node rank; torchrun's static rendezvous makes node 0's rank 0 global rank 0, so the node, its
key and its network stay on node 0, whose launcher alone checks and hands over the key. The other
launchers need no keystore: their ranks only train. Every rank checks, before training, that it runs
rank 0's run config and sees rank 0's output directory (DCP shards and checkpoints are written by
every rank into one directory, so it must be storage every node shares).
"""

from __future__ import annotations

import argparse
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
import traceback
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

if TYPE_CHECKING:
    from crypto.keys import WalletKey
    from prime_node.config import RunConfig
    from prime_node.ml.distributed import DistInfo
    from prime_node.ml.trainer import StepMetrics
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
) -> None:
    """Run ``module`` on ``nproc`` ranks of this node under torchrun and wait for it.

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
    stops = _StopForwarder()
    with stops.installed():
        process = subprocess.Popen(
            torchrun_command(module, args, nproc, rendezvous),
            env=torchrun_env(interface),
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
            run_torchrun(ENTRY_MODULE, args, nproc, rendezvous=rendezvous, on_started=handoff.serve)
        finally:
            handoff.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# -- every rank ------------------------------------------------------------------------------------------


def run_rank(directory: Path, dist: DistInfo) -> bool:
    """Rank 0: the node (until a signal, or max_steps with exit_when_done). Ranks > 0: follow it.
    True when every rank left the session together (they may meet in a last barrier)."""
    spec = LaunchSpec.read(directory)
    from prime_node.ml.distributed import check_same_run, spans_machines

    if spans_machines(dist):
        check_same_run(spec.run, dist)
    if dist.is_main:
        return _run_node(spec, directory, dist)
    return _follow(spec, dist)


def _run_node(spec: LaunchSpec, directory: Path, dist: DistInfo) -> bool:
    from prime_node.roles.trainer_node import build_trainer_node, run_trainer_node, step_line

    key = receive_key(directory)

    def echo(line: str) -> None:
        print(line, flush=True)

    parts = build_trainer_node(
        spec.node,
        spec.run,
        key,
        dataplane_host=spec.dataplane_host,
        dataplane_port=spec.dataplane_port,
        on_step=lambda metrics: echo(step_line(metrics)),
        dist=dist,
    )
    run_trainer_node(spec.node, parts, key, echo=echo, exit_when_done=spec.exit_when_done)
    return bool(parts.trainer.stopped_ranks)


def _follow(spec: LaunchSpec, dist: DistInfo) -> bool:
    """Train every step rank 0 broadcasts; one JSON line per step on stderr (which rank took which)."""
    from prime_node.ml.session import TrainingSession

    for sig in (signal.SIGINT, signal.SIGTERM):
        # Rank 0 stops this rank through the session once its step is done (and gloo fails here if
        # rank 0 is gone); torchrun SIGKILLs a rank that outlives its stop deadline.
        signal.signal(sig, signal.SIG_IGN)
    assert spec.run.model_dir is not None  # the launcher checked
    session = TrainingSession(spec.run, base=spec.run.model_dir, dist=dist)

    def say(line: dict[str, object]) -> None:
        print(json.dumps({"rank": dist.rank, **line}), file=sys.stderr, flush=True)

    say({"pid": os.getpid(), "following_from_step": session.step})

    def on_step(metrics: StepMetrics) -> None:
        say(
            {
                "step": metrics.step,
                "policy_step": metrics.policy_step,
                "groups_kept": metrics.groups_kept,
                "reward": metrics.reward_mean,
                "loss": metrics.loss,
                "grad_norm": metrics.grad_norm,
            }
        )

    try:
        session.follow(on_step)
    finally:
        session.close()
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=ENTRY_MODULE)
    parser.add_argument("--launch-dir", type=Path, required=True)
    parser.add_argument("--gpu", default="auto", help="run-trainer --gpu: auto, none or indices (0,1)")
    args = parser.parse_args(argv)
    level = os.environ.get("PRIME_NODE_LOG_LEVEL", "warning").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from crypto.errors import CryptoError
    from prime_node.ml.distributed import init_from_env, shutdown
    from protocol.errors import ProtocolError

    # torchrun gives each rank a process group of its own: if torchrun itself is killed, its ranks
    # should not live on. Rank 0 stops as on SIGTERM; the others hold nothing worth a clean exit.
    rank = int(os.environ.get("RANK", "0"))
    set_death_signal = death_signal_setter(signal.SIGTERM if rank == 0 else signal.SIGKILL)
    if set_death_signal is not None:
        set_death_signal()
        if os.getppid() == 1:  # torchrun died before the request took effect
            return 1
    try:  # this rank's device: select_device for its LOCAL_RANK (a missing GPU is a clear error)
        from prime_node.hardware import parse_gpu_selection

        dist = init_from_env(parse_gpu_selection(args.gpu))
    except NodeError as exc:
        print(f"error: trainer rank {rank}: {exc}", file=sys.stderr)
        return 1
    try:
        together = run_rank(args.launch_dir, dist)
    except (NodeError, CryptoError, ProtocolError) as exc:
        print(f"error: trainer rank {dist.rank}: {exc}", file=sys.stderr)
        together, code = False, 1
    except KeyboardInterrupt:
        together, code = False, 130
    except RuntimeError as exc:  # torch.distributed's errors (e.g. gloo: "Connection closed by peer")
        log.debug("trainer rank %d failed", dist.rank, exc_info=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"error: trainer rank {dist.rank}: {first}", file=sys.stderr)
        together, code = False, 1
    except BaseException as exc:
        lost = _collective_error(exc)
        if lost is None:
            traceback.print_exc()
        else:  # the node's nursery wraps the step's error: say it in one line, as above
            log.debug("trainer rank %d failed", dist.rank, exc_info=True)
            print(
                f"error: trainer rank {dist.rank}: a collective failed (a rank is gone?): {lost}",
                file=sys.stderr,
            )
        together, code = False, 1
    else:
        code = 0
    try:
        shutdown(together=together)
    except Exception as exc:  # a rank that left without the last barrier: torchrun reports which
        print(f"error: trainer rank {dist.rank}: leaving the process group failed: {exc}", file=sys.stderr)
        code = code or 1
    return code


def _collective_error(exc: BaseException) -> str | None:
    """The first line of the torch.distributed error (a RuntimeError) at the bottom of an exception
    group, or None when the group holds something else: that deserves its whole traceback."""
    if not isinstance(exc, BaseExceptionGroup):
        return None
    runtime, rest = exc.split(RuntimeError)
    if runtime is None or rest is not None:
        return None
    leaf: BaseException = runtime
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    text = str(leaf).strip()
    return text.splitlines()[0] if text else type(leaf).__name__


if __name__ == "__main__":
    from prime_node.ml.distributed import exit_process

    exit_process(main())
