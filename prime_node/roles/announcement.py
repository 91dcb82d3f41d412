"""The run announcement on the network: the trainer gossips it, every node that believes it re-serves it.

Trainer side (``RunAnnouncer(key=..., run_config=...)``): signs the run config once and gossips it on
topic ``run`` every ``period`` seconds (gossip is lossy and late joiners missed the first one).

Joiner side (``RunFollower(run_id, pinned=...)``): listens on the topic and also asks each connected peer
directly (``/prime-node/run/1``: the peer answers with the envelope frame it believes), so a joiner
needs no more than a bootstrap address and does not wait a whole period. ``TrainerTrust`` decides whom
to believe (pin, or trust on first use). Both sides serve the envelope they hold on the direct protocol.

Local paths (model_dir, output_dir) never travel: the trainer leaves them out and each worker builds
its ``RunConfig`` with its own (``worker_run_config``).
"""

from __future__ import annotations

import logging
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


def announced_config(config: RunConfig, trainer: Address) -> bytes:
    """The canonical JSON the trainer signs: every field but local paths, with its own address."""
    data = config.model_dump(mode="json", exclude=set(LOCAL_FIELDS))
    data["trainer_address"] = str(trainer)
    encoded = canonical_json(data)
    if len(encoded) > MAX_CONFIG_BYTES:
        raise NodeError(
            f"the run config is {len(encoded)} bytes as JSON, over the {MAX_CONFIG_BYTES}-byte cap",
            reason="bad_config",
        )
    return encoded


def worker_run_config(
    announcement: RunAnnouncement, *, model_dir: Path | None = None, output_dir: Path | None = None
) -> RunConfig:
    """A worker's RunConfig from a believed announcement, with its own local paths."""
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
    return validate_run_config(data, source=f"run {announcement.run_id}'s announced config")


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
    """A joiner's side: believe one trainer's announcement (pinned or first), then re-serve it.

    ``wait()`` returns the believed announcement; ``on_trusted`` is called once, when the first one is
    accepted (the CLI prints the trainer address there).
    """

    def __init__(
        self,
        run_id: str,
        *,
        pinned: Address | None = None,
        on_trusted: Any = None,
        ask_interval: float = ASK_INTERVAL,
    ) -> None:
        self.trust = TrainerTrust(run_id, pinned=pinned)
        self.on_trusted = on_trusted
        self.ask_interval = ask_interval
        self.refused: dict[str, int] = {}
        self._known = trio.Event()

    @property
    def announcement(self) -> RunAnnouncement | None:
        return self.trust.current

    async def wait(self) -> RunAnnouncement:
        await self._known.wait()
        assert self.trust.current is not None
        return self.trust.current

    def offer(self, frame: bytes, now_ms: int, source: str) -> RunAnnouncement | None:
        """Feed one announcement envelope frame from anywhere; the believed announcement or None."""
        try:
            envelope = decode(frame, Envelope)
            announcement = self.trust.offer(envelope, now_ms=now_ms)
        except ProtocolError as exc:
            self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
            log.info("refused a run announcement from %s: %s", source, exc)
            return None
        if not self._known.is_set():
            self.frame = frame
            self._known.set()
            how = "pinned" if self.trust.pinned is not None else "trusted on first use"
            log.info("run %s: trainer %s (%s)", announcement.run_id, announcement.trainer, how)
            if self.on_trusted is not None:
                self.on_trusted(announcement, self.trust.trusted_on_first_use)
        elif envelope is self.trust.envelope:
            self.frame = frame
        return announcement

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        context.host.set_stream_handler(RUN_PROTOCOL, self.serve)

        async def on_gossip(message: Delivered) -> None:
            self.offer(message.payload, context.clock.wall_ms(), message.origin_peer_id)

        await context.gossip.subscribe(RUN_TOPIC, on_gossip)
        task_status.started()
        asked: set[str] = set()
        async with trio.open_nursery() as asking:
            while not self._known.is_set():
                for peer in context.host.connected_peers():
                    if peer not in asked:
                        asked.add(peer)
                        asking.start_soon(self._ask, context, peer)
                with trio.move_on_after(self.ask_interval):
                    await self._known.wait()
                if not self._known.is_set() and len(asked) >= len(context.host.connected_peers()):
                    asked.clear()  # ask again: a peer may have learnt of the run since
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
