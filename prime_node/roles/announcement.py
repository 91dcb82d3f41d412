"""The run announcement on the network: the trainer gossips it, every node that believes it re-serves it.

Trainer side (``RunAnnouncer(key=..., run_config=...)``): signs the run config once and gossips it on
topic ``run`` every ``period`` seconds (gossip is lossy and late joiners missed the first one).

Joiner side (``RunFollower(run_id, pinned=...)``): listens on the topic and also asks each connected peer
directly (``/prime-node/run/1``: the peer answers with the envelope frame it believes), so a joiner
needs a bootstrap address and the trainer's address (one ``RUN@0xTRAINER,BOOTSTRAP`` string) and does
not wait a whole period. ``TrainerTrust`` believes only the pinned trainer; without a pin the follower
believes nobody and tells the operator which trainers announce the run and what to pass (``notify``,
the log, and ``status_rows`` for ``prime-node status``), as it does for every conflicting announcement
a pinned follower refuses. Both sides serve the envelope they believe on the direct protocol.

Local paths (model_dir, output_dir) never travel: the trainer leaves them out and each worker builds
its ``RunConfig`` with its own (``worker_run_config``). A task file travels as its name and SHA-256
only: the worker reads its own copy from DATA_DIR/tasks/ if the digest matches, so an announcement never
names a file on the worker's disk. A task file is data to a worker: an inferer reads prompts from it;
only a validator runs a code task's tests, in the sandbox, on the pinned trainer's file.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from crypto.keys import Address, WalletKey
from prime_node.config import RunConfig
from prime_node.config.run import validate_run_config
from prime_node.errors import NodeError
from protocol.codec import decode, encode
from protocol.envelope import Envelope
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.run_announcement import (
    MAX_CONFIG_BYTES,
    RUN_TOPIC,
    RunAnnouncement,
    Sighting,
    TrainerTrust,
    canonical_json,
    config_of,
    seal_announcement,
)

if TYPE_CHECKING:
    from prime_node.node.context import NodeContext
    from prime_node.node.gossip import Delivered
    from prime_node.p2p.interface import FramedStream

log = logging.getLogger(__name__)
RUN_PROTOCOL = "/prime-node/run/1"
LOCAL_FIELDS = ("model_dir", "output_dir")
MAX_FRAME = MAX_CONFIG_BYTES + 4096
ANNOUNCE_PERIOD = 5.0
ASK_INTERVAL = 1.0
UNPINNED_ASKS = 3
"""Peers an unpinned follower asks at all. Only the trainer and pinned followers have an answer, and
the trainer gossips every ``ANNOUNCE_PERIOD``; asking every peer cost each joiner a stream to each of
its ~18 connected peers during a join burst (docs/benchmarks.md, *Discovery*), for no answer."""
TASK_DIGEST = "task_file_sha256"
"""The announced config's extra field: the SHA-256 of the run's task file (not a RunConfig field)."""
_TASK_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def announced_config(config: RunConfig, trainer: Address) -> bytes:
    """The canonical JSON the trainer signs: every field but local paths, with its own address. A task
    file is announced as its bare name and its SHA-256 (``TASK_DIGEST``), never as a path."""
    data = config.model_dump(mode="json", exclude=set(LOCAL_FIELDS))
    data["trainer_address"] = str(trainer)
    if config.task.path is not None:
        data["task"]["path"] = config.task.path.name
        data[TASK_DIGEST] = file_sha256(config.task.path)
    encoded = canonical_json(data)
    if len(encoded) > MAX_CONFIG_BYTES:
        raise NodeError(
            f"the run config is {len(encoded)} bytes as JSON, over the {MAX_CONFIG_BYTES}-byte cap",
            reason="bad_config",
        )
    return encoded


def worker_run_config(
    announcement: RunAnnouncement,
    *,
    model_dir: Path | None = None,
    output_dir: Path | None = None,
    task_dir: Path | None = None,
) -> RunConfig:
    """A worker's RunConfig from a believed announcement, with its own local paths.

    A run with a task file names it and its digest; the worker uses ``task_dir/NAME`` only if its
    SHA-256 is the announced one (the file is put there by the operator: it never comes from the swarm,
    and a path in the announcement never makes this node open a file of its choosing). NodeError
    ``task_file`` otherwise. Blocking (hashes the file): call it from a thread.
    """
    try:
        data: dict[str, Any] = config_of(announcement)
    except RemoteProtocolError as exc:
        raise NodeError(f"announced run config: {exc}", reason="bad_run_config") from exc
    for name in LOCAL_FIELDS:
        data.pop(name, None)
    if model_dir is not None:
        data["model_dir"] = str(model_dir)
    if output_dir is not None:
        data["output_dir"] = str(output_dir)
    data["trainer_address"] = str(announcement.trainer)
    digest = data.pop(TASK_DIGEST, None)
    task = data.get("task")
    if isinstance(task, dict) and task.get("path") is not None:
        task["path"] = str(_local_task_file(announcement.run_id, task["path"], digest, task_dir))
    return validate_run_config(data, source=f"run {announcement.run_id}'s announced config")


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file (what a run announces for its task file); NodeError if unreadable."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    except OSError as exc:
        raise NodeError(
            f"cannot read task file {str(path)[:200]}: {exc.strerror}", reason="task_file"
        ) from None
    return digest.hexdigest()


def _local_task_file(run_id: str, name: Any, digest: Any, task_dir: Path | None) -> Path:
    if not isinstance(name, str) or not _TASK_NAME.fullmatch(name) or name in (".", ".."):
        raise NodeError(
            f"run {run_id} announces a task file name that is not a plain file name", reason="task_file"
        )
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise NodeError(f"run {run_id} announces task file {name} without its SHA-256", reason="task_file")
    if task_dir is None:
        raise NodeError(
            f"run {run_id} needs its task file {name}, and this node has no task directory",
            reason="task_file",
        )
    local = task_dir / name
    if not local.is_file():
        raise NodeError(
            f"run {run_id} trains on the task file {name} (sha256 {digest}): get it from the run's operator "
            f"and put it at {local}",
            reason="task_file",
        )
    found = file_sha256(local)
    if found != digest:
        raise NodeError(
            f"{local} has sha256 {found}, but run {run_id} announces {digest}: not the run's task file",
            reason="task_file",
        )
    return local


class _Served:
    """Serves the envelope frame this node holds (if any) on the direct protocol."""

    frame: bytes | None = None

    async def serve(self, stream: FramedStream) -> None:
        try:
            if self.frame is not None:
                await stream.send_frame(self.frame)
        except NodeError as exc:
            log.debug("serving the run announcement failed: %s", exc)
        finally:
            await stream.close()


class RunAnnouncer(_Served):
    """The trainer's side: sign the run config and keep gossiping it."""

    def __init__(self, *, key: WalletKey, run_config: RunConfig, period: float = ANNOUNCE_PERIOD) -> None:
        self.key = key
        self.run_config = run_config
        self.period = period
        self.config_json = announced_config(run_config, key.address)

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        announcement = RunAnnouncement(
            run_id=self.run_config.run_id,
            trainer=self.key.address,
            config_json=self.config_json,
            issued_at_ms=context.clock.wall_ms(),
        )
        context.host.set_stream_handler(RUN_PROTOCOL, self.serve)

        async def ignore(message: Delivered) -> None:
            return None

        await context.gossip.subscribe(RUN_TOPIC, ignore)  # joins the mesh, so our publishes propagate
        task_status.started()
        while True:
            # Re-sealed each period: a fresh envelope timestamp keeps it inside receivers' windows.
            envelope = seal_announcement(self.key, announcement, now_ms=context.clock.wall_ms())
            self.frame = encode(envelope)
            try:
                await context.gossip.publish(RUN_TOPIC, self.frame)
            except NodeError as exc:
                log.debug("run announcement not gossiped: %s", exc)
            await trio.sleep(self.period)


class RunFollower(_Served):
    """A joiner's side: believe the pinned trainer's announcement, then re-serve it; without a pin,
    believe nobody and report who announces the run.

    ``wait()`` returns the believed announcement (never, without a pin). ``notify`` gets the lines an
    operator must read (the trainer followed, a refusal that names what to pass, a conflicting trainer).
    """

    def __init__(
        self,
        run_id: str,
        *,
        pinned: Address | None = None,
        notify: Callable[[str], None] | None = None,
        ask_interval: float = ASK_INTERVAL,
    ) -> None:
        self.trust = TrainerTrust(run_id, pinned=pinned)
        self.notify = notify
        self.ask_interval = ask_interval
        self.refused: dict[str, int] = {}
        self._known = trio.Event()
        self._flood_reported = False

    @property
    def announcement(self) -> RunAnnouncement | None:
        return self.trust.current

    async def wait(self) -> RunAnnouncement:
        await self._known.wait()
        assert self.trust.current is not None
        return self.trust.current

    def refusal(self) -> str:
        """Why an unpinned node takes no role, what to pass instead, and the trainers seen so far."""
        run = self.trust.run_id
        seen = [str(s.address) for s in self.trust.sightings.values()]
        heard = f"trainers announcing it: {', '.join(seen)}" if seen else "no trainer has announced it yet"
        return (
            f"run {run}: no trainer pinned, so this node takes no role ({heard}). Anyone can announce any "
            f"run: ask the run's operator for its run address and restart with --run {run}@0xTRAINER "
            "(or --trainer 0xTRAINER)"
        )

    def status_rows(self, now_ms: int) -> list[dict[str, Any]]:
        """The announcements seen, newest first: who, which run, believed or why not (``status``)."""
        rows = []
        for seen in reversed(self.trust.sightings.values()):
            rows.append(
                {
                    "run": str(seen.address),
                    "followed": seen.run_id == self.trust.run_id and seen.trainer == self.trust.pinned,
                    "announcements": seen.announcements,
                    "last_seen_s": round(max(0, now_ms - seen.last_seen_ms) / 1000, 1),
                }
            )
        return rows

    def offer(self, frame: bytes, now_ms: int, source: str) -> RunAnnouncement | None:
        """Feed one announcement envelope frame from anywhere; the believed announcement or None."""
        try:
            envelope = decode(frame, Envelope)
            announcement = self.trust.offer(envelope, now_ms=now_ms)
        except ProtocolError as exc:
            self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
            seen = self.trust.latest
            if seen is not None and seen.announcements == 1:
                self._report(seen, source)
            else:
                log.debug("refused a run announcement from %s: %s", source, exc)
            return None
        if not self._known.is_set():
            self.frame = frame
            self._known.set()
            self._say(f"run {announcement.run_id}: following trainer {announcement.trainer} (pinned)")
        elif envelope is self.trust.envelope:
            self.frame = frame
        return announcement

    def _report(self, seen: Sighting, source: str) -> None:
        """Tell the operator, once per (run, trainer), about an announcement this node does not believe."""
        if self.trust.forgotten:
            if not self._flood_reported:
                self._flood_reported = True
                self._say(
                    f"run {self.trust.run_id}: more than {self.trust.max_sightings} keys announce runs "
                    "here; someone is flooding announcements (only the newest are listed in status)"
                )
            return
        run, pinned = self.trust.run_id, self.trust.pinned
        if seen.run_id != run:
            self._say(f"peer {source} serves run {seen.address}, not run {run} (not followed)")
        elif pinned is None:
            self._say(self.refusal())
        else:
            self._say(
                f"run {run}: {seen.trainer} also announces this run (via {source}); refused: "
                f"the pinned trainer is {pinned}"
            )

    def _say(self, line: str) -> None:
        if self.notify is None:
            log.warning("%s", line)
        else:  # the operator reads it from notify (join: stderr); the log keeps a copy
            log.info("%s", line)
            self.notify(line)

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        context.host.set_stream_handler(RUN_PROTOCOL, self.serve)

        async def on_gossip(message: Delivered) -> None:
            self.offer(message.payload, context.clock.wall_ms(), message.origin_peer_id)

        await context.gossip.subscribe(RUN_TOPIC, on_gossip)
        task_status.started()
        if self.trust.pinned is None:
            self._say(self.refusal())
        asked: set[str] = set()
        unpinned_asks = 0
        async with trio.open_nursery() as asking:
            # Pinned: ask every peer until the trainer's announcement is believed (again and again: a
            # peer may learn of the run later). Unpinned: ask the first few peers, only to list who
            # announces what sooner; gossip brings the rest (``UNPINNED_ASKS``).
            while not self._known.is_set():
                connected = set(context.host.connected_peers())
                for peer in connected - asked:
                    if self.trust.pinned is None:
                        if unpinned_asks >= UNPINNED_ASKS:
                            break
                        unpinned_asks += 1
                    asked.add(peer)
                    asking.start_soon(self._ask, context, peer)
                asked &= connected
                with trio.move_on_after(self.ask_interval):
                    await self._known.wait()
                if self.trust.pinned is not None and not self._known.is_set() and asked >= connected:
                    asked.clear()
            asking.cancel_scope.cancel()  # believed: the answers still on their way are not needed

    async def _ask(self, context: NodeContext, peer: str) -> None:
        try:
            with trio.fail_after(10):
                stream = await context.host.open_stream(peer, RUN_PROTOCOL)
                try:
                    frame = await stream.receive_frame(MAX_FRAME)
                finally:
                    await stream.close()
        except (NodeError, ProtocolError, trio.TooSlowError) as exc:
            log.debug("asking %s for the run announcement failed: %s", peer, exc)
            return
        if frame is not None:
            self.offer(frame, context.clock.wall_ms(), peer)
