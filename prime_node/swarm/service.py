"""The weight swarm as a node service: share, announce, discover, fetch and re-serve checkpoints.

One ``CheckpointTransfer`` per version, all over one data plane (prime_node/swarm/transport.py): every
frame names its manifest id and is routed to that version's transfer. Who offered what, which manifests
we wait for, which versions to follow and which to drop is decided by the sans-IO catalogue
(protocol/swarm/catalogue.py). This service composes the parts that do the I/O around it:

- ``VersionExchange`` (exchange.py): the data plane, offers and manifest requests, frame routing, bans;
- ``Holdings`` (holdings.py): the versions held, their transfers, stores and files (store_layout.py);
- ``keep_neighbours`` (neighbours.py): which members to connect to;
- here: gossip announcements, sharing, fetching, following and restoring after a restart.

Only manifests whose envelope the run's trainer signed are accepted (``fetch`` by id also accepts an
id-pinned manifest when no trainer is configured). The trainer announces each version on the gossip
topic ``CHECKPOINTS_TOPIC`` (protocol/topics.py), the signed manifest inside when it fits, else its id;
with ``follow`` a node fetches every trainer-signed version it hears of by itself, newest first, and
keeps the newest ``keep`` complete versions (K = async level + 1). A restarted node re-serves complete
versions and resumes unfinished ones from their verified pieces.
"""

from __future__ import annotations

import logging
import random
from functools import partial
from pathlib import Path
from typing import Any

import trio

from crypto.keys import Address, WalletKey
from prime_node.dataplane.streams import TCP, StreamTransport
from prime_node.errors import NodeError
from prime_node.node.clock import NodeClock
from prime_node.node.context import NodeContext, RecordPart
from prime_node.node.gossip import Delivered
from prime_node.swarm.checkpoint import build_checkpoint
from prime_node.swarm.exchange import VersionExchange
from prime_node.swarm.holdings import Holdings
from prime_node.swarm.neighbours import MAX_NEIGHBOURS, keep_neighbours
from prime_node.swarm.store_layout import StoreLayout
from prime_node.swarm.transfer import OriginDirectory
from prime_node.swarm.versions import Version, open_known
from protocol.codec import decode, encode
from protocol.envelope import Envelope
from protocol.errors import RemoteProtocolError
from protocol.manifest import Manifest, open_manifest
from protocol.peer_record import peer_id_of
from protocol.scoring import Offence
from protocol.swarm.catalogue import Catalogue, CatalogueAction
from protocol.swarm.messages import MAX_ANNOUNCED_ENVELOPE_BYTES, Announce
from protocol.topics import CHECKPOINTS_TOPIC

log = logging.getLogger(__name__)

STATUS_SECTION = "checkpoints"
TICK = 0.25
"""Seconds between ticks: request timeouts, super-seeding deadlines (as short as 0.25 s), expiring waits."""


class SwarmService:
    """See the module doc. Start it as a node service; the public API is ``share``, ``fetch``,
    ``locate``, ``newest``, ``wait_newer``, ``wait_changed``, ``progress`` and ``status``."""

    def __init__(
        self,
        *,
        key: WalletKey,
        run_id: str,
        trainer: Address | None,
        store_dir: Path,
        dataplane_host: str = "0.0.0.0",
        dataplane_port: int = 0,
        keep: int = 2,
        follow: bool = True,
        upload: bool = True,
        max_neighbours: int = MAX_NEIGHBOURS,
        seed: int | None = None,
        transport: StreamTransport = TCP,
    ) -> None:
        if keep < 1:
            raise NodeError("keep must be at least 1", reason="bad_config")
        self.key = key
        self.run_id = run_id
        self.store_dir = store_dir
        self.layout = StoreLayout(store_dir)
        self.dataplane_host = dataplane_host
        self.dataplane_port = dataplane_port
        self.max_neighbours = max_neighbours
        self.rng = random.Random(seed)
        self.catalogue: Catalogue[Address] = Catalogue(keep=keep, follow=False)
        self._trainer = trainer
        self._follow = follow
        self._sync_follow()
        self.holdings = Holdings(
            self.layout,
            rng=self.rng,
            upload=upload,
            # Late-bound: the exchange and its data plane come next (and a test swaps ``dataplane.send``).
            send=lambda peer, frame: self.dataplane.send(peer, frame),  # type: ignore[arg-type]  # noqa: PLW0108
            close=lambda peer, why: self.exchange.on_transfer_close(peer, why),  # type: ignore[arg-type]  # noqa: PLW0108
            on_complete=self._on_complete,
        )
        self.versions = self.holdings.versions
        self.known = self.holdings.known
        self.exchange = VersionExchange(
            key,
            self.catalogue,
            self.holdings,
            now=self._now,
            trainer=lambda: self.trainer,
            on_follow=self._start_following,
            on_drop=self._on_drop,
            on_offence=self._offence,
            transport=transport,
        )
        self.dataplane = self.exchange.dataplane
        self._context: NodeContext | None = None
        self._nursery: trio.Nursery | None = None
        self._port: int | None = None

    # --- settings the role runner changes once the run is announced -----------------------------------

    @property
    def trainer(self) -> Address | None:
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: Address | None) -> None:
        self._trainer = trainer
        self._sync_follow()

    @property
    def follow(self) -> bool:
        return self._follow

    @follow.setter
    def follow(self, follow: bool) -> None:
        self._follow = follow
        self._sync_follow()

    @property
    def keep(self) -> int:
        return self.catalogue.keep

    @keep.setter
    def keep(self, keep: int) -> None:
        self.catalogue.keep = keep

    def _sync_follow(self) -> None:
        """Only trainer-signed versions are followed, so following waits until the trainer is known."""
        self.catalogue.follow = self._follow and self._trainer is not None

    # --- lifecycle ------------------------------------------------------------------------------------

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._context = context
        self.layout.prepare()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._port = await nursery.start(self.dataplane.run, self.dataplane_host, self.dataplane_port)
                # Before the node's first heartbeat, so peers learn the data-plane port at once.
                context.add_record_source(self._record_part)
                await context.gossip.subscribe(CHECKPOINTS_TOPIC, self._on_announce)
                context.add_status_section(STATUS_SECTION, self.status)
                self._restore()
                nursery.start_soon(self._tick_loop)
                neighbours = partial(
                    keep_neighbours,
                    self.dataplane,
                    context,
                    own=self.key.address,
                    max_neighbours=self.max_neighbours,
                    rng=self.rng,
                )
                nursery.start_soon(neighbours)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self.holdings.close_stores()

    @property
    def context(self) -> NodeContext:
        if self._context is None:
            raise NodeError("the swarm service is not running", reason="not_running")
        return self._context

    @property
    def nursery(self) -> trio.Nursery:
        if self._nursery is None:
            raise NodeError("the swarm service is not running", reason="not_running")
        return self._nursery

    @property
    def bound_port(self) -> int:
        """The data plane's listening port (known once the service runs)."""
        if self._port is None:
            raise NodeError("the swarm service is not running", reason="not_running")
        return self._port

    @property
    def clock(self) -> NodeClock:
        return self.context.clock

    def _now(self) -> float:
        return self.clock.now()

    def _record_part(self) -> RecordPart:
        """What this service adds to the node's peer record: its data-plane port and the steps held."""
        return RecordPart(versions_held=self.holdings.held_steps(), dataplane_port=self._port)

    # --- public API -----------------------------------------------------------------------------------

    async def share(self, directory: Path, *, step: int, piece_size: int | None = None) -> Manifest:
        """Hash and sign ``directory`` (``key`` must be the run's trainer key), announce it and seed it,
        super-seeding, until the service stops."""
        if self.trainer is not None and self.key.address != self.trainer:
            raise NodeError(
                f"only the run's trainer {self.trainer} may share checkpoints "
                f"(this key is {self.key.address})",
                reason="not_trainer",
            )
        now_ms = self.clock.wall_ms()
        shared = await trio.to_thread.run_sync(
            lambda: build_checkpoint(
                directory, self.key, run=self.run_id, step=step, now_ms=now_ms, piece_size=piece_size
            )
        )
        manifest, envelope = shared.manifest, shared.envelope
        mid = manifest.id()
        if mid not in self.versions:
            source = OriginDirectory(directory, manifest)
            self._hold(self.holdings.add(manifest, envelope, source, store=None, path=directory, origin=True))
        payload = encode(envelope)
        announce = Announce(
            mid, self.run_id, step, payload if len(payload) <= MAX_ANNOUNCED_ENVELOPE_BYTES else b""
        )
        try:
            await self.context.gossip.publish(CHECKPOINTS_TOPIC, encode(announce))
        except NodeError as exc:
            log.info("checkpoint announcement not gossiped (peers will still learn it on connect): %s", exc)
        log.info("sharing step %d as %s (%d pieces)", step, mid.hex(), manifest.piece_count)
        return manifest

    async def fetch(self, manifest_id: bytes, *, out: Path | None = None) -> Path:
        """Download the version ``manifest_id`` from peers, verify it and return its complete directory
        (``out`` if given, written atomically; else inside the store). Resumes from verified pieces."""
        version = self.versions.get(manifest_id)
        if version is None:
            envelope, manifest = await self.get_manifest(manifest_id)
            version = self.versions.get(manifest_id)
            if version is None:
                version = self._start_fetch(manifest, envelope, out)
        await version.done.wait()
        if version.error is not None:
            raise version.error
        assert version.path is not None
        return version.path

    async def get_manifest(self, mid: bytes) -> tuple[Envelope, Manifest]:
        """The signed manifest ``mid``, from memory or asked of every neighbour (waits until one answers;
        NodeError ``wrong_signer`` if it is not the trainer's)."""
        return await self.exchange.get_manifest(mid)

    def locate(self, step: int) -> Path | None:
        """The complete, verified directory of ``step``, if held."""
        return self.holdings.locate(step)

    def newest(self) -> tuple[int, Path] | None:
        return self.holdings.newest()

    async def wait_newer(self, than: int | None) -> tuple[int, Path]:
        """Wait until a complete checkpoint with a step above ``than`` (any, if None) is held."""
        return await self.holdings.wait_newer(than)

    async def wait_changed(self) -> None:
        """Return at the next change of the held versions (one completed, dropped or added)."""
        await self.holdings.changed.wait()

    def progress(self, manifest_id: bytes) -> tuple[int, int] | None:
        """(pieces held, piece count) of a version, or None if unknown."""
        return self.holdings.progress(manifest_id)

    def resumed_pieces(self, manifest_id: bytes) -> int:
        return self.holdings.resumed_pieces(manifest_id)

    def status(self) -> dict[str, Any]:
        return {
            "versions": self.holdings.status(),
            "bytes_in": self.dataplane.bytes_in,
            "bytes_out": self.dataplane.bytes_out,
            "peers": len(self.dataplane.links),
        }

    # --- versions -------------------------------------------------------------------------------------

    def _hold(self, version: Version) -> Version:
        """Tell the catalogue about a version just added to the holdings (it offers it to neighbours)."""
        complete = version.path is not None
        self.exchange.apply(
            self.catalogue.add_version(version.manifest.id(), version.step, complete=complete)
        )
        return version

    def _start_fetch(self, manifest: Manifest, envelope: Envelope, out: Path | None) -> Version:
        version = self._hold(self.holdings.start_fetch(manifest, envelope, out))
        if version.store is not None and version.store.complete:
            self.nursery.start_soon(self._finish, version)
        return version

    def _start_following(self, mid: bytes) -> None:
        """Fetch a version the catalogue follows, once its manifest proves it the trainer's, of our run."""
        try:
            envelope = self.known.get(mid)
            if envelope is None:
                raise NodeError(f"no manifest for {mid.hex()}", reason="manifest_not_found")
            manifest = open_known(envelope, mid, self.trainer)
            if manifest.run != self.run_id:
                log.warning("not following %s: it belongs to run %s", mid.hex()[:16], manifest.run)
                self.catalogue.follow_ended(mid)
            elif mid not in self.versions:
                self._start_fetch(manifest, envelope, None)
        except NodeError as exc:
            log.warning("could not fetch checkpoint %s: %s", mid.hex()[:16], exc)
            self.catalogue.follow_ended(mid)

    def _on_complete(self, version: Version) -> None:
        if not version.origin and version.path is None:
            self.nursery.start_soon(self._finish, version)

    async def _finish(self, version: Version) -> None:
        if version.store is None or version.done.is_set():
            return
        mid = version.manifest.id()
        if not await self.holdings.finish(version):
            self._drop_version(version, delete=False)
            version.done.set()
            return
        if mid in self.catalogue.versions:
            self.exchange.apply(self.catalogue.version_complete(mid))
        self.holdings.notify()

    def _on_drop(self, mid: bytes) -> None:
        version = self.versions.get(mid)
        if version is not None:
            log.info("dropping step %d (keeping the newest %d)", version.step, self.keep)
            self._drop_version(version, delete=not version.origin)

    def _drop_version(self, version: Version, *, delete: bool) -> None:
        self.catalogue.remove_version(version.manifest.id())
        self.holdings.remove(version, delete=delete, now=self.clock.now())

    def _restore(self) -> None:
        """Re-serve complete versions found on disk; resume unfinished ones (when following)."""
        follows: list[CatalogueAction[Address]] = []
        for mid, envelope, manifest in self.layout.saved_manifests(self.trainer):
            directory = self.layout.checkpoint_dir(manifest)
            if directory.is_dir():
                source = OriginDirectory(directory, manifest)
                self._hold(
                    self.holdings.add(manifest, envelope, source, store=None, path=directory, origin=False)
                )
            elif self.follow and self.layout.has_pieces(mid):
                self.known[mid] = envelope
                follows += self.catalogue.heard_of(mid, manifest.step, self.clock.now(), have_manifest=True)
        self.exchange.apply(self.catalogue.retain())
        self.exchange.apply(follows)

    # --- events ---------------------------------------------------------------------------------------

    async def _on_announce(self, message: Delivered) -> None:
        if self.trainer is None or message.origin != self.trainer:
            log.debug("ignoring a checkpoint announcement from %s (not the trainer)", message.origin)
            return
        try:
            announce = decode(message.payload, Announce)
            mid = announce.manifest_id
            if announce.envelope and mid not in self.known:
                envelope = decode(announce.envelope, Envelope)
                open_manifest(envelope, trainer=self.trainer, run=self.run_id, expected_id=mid)
                self.known[mid] = envelope
        except RemoteProtocolError as exc:
            log.warning("ignoring a malformed checkpoint announcement: %s", exc)
            return
        if announce.run == self.run_id:
            now, known = self.clock.now(), mid in self.known
            self.exchange.apply(self.catalogue.heard_of(mid, announce.step, now, have_manifest=known))

    def _offence(self, peer: Address, reason: str) -> None:
        """Tell the node's peer policy (gossip, heartbeats) about a peer banned from the weight swarm."""
        context = self._context
        if context is None or not context.is_running:
            return
        peer_id = peer_id_of(peer, context.membership.members())
        if peer_id is not None:
            context.policy.offence(peer_id, Offence.BAD_DATA, reason)

    async def _tick_loop(self) -> None:
        while True:
            await trio.sleep(TICK)
            now = self.clock.now()
            for version in list(self.versions.values()):
                version.transfer.tick(now)
            self.exchange.apply(self.catalogue.tick(now))
