"""The weight swarm as a node service: share, announce, discover, fetch and re-serve checkpoints.

One ``CheckpointTransfer`` per version, all over one data plane (prime_node/swarm/transport.py): every
frame names its manifest id and is routed to that version's transfer. Who offered what, which manifests
we wait for, which versions to follow and which to drop is decided by the sans-IO catalogue
(protocol/swarm/catalogue.py). This service composes the parts that do the I/O around it:

- ``VersionExchange`` (version_exchange.py): the data plane, offers, manifest requests, frame routing, bans;
- ``Holdings`` (holdings.py): the versions held, their transfers, stores and files (store_layout.py);
- ``keep_neighbours`` (neighbours.py): which members to connect to;
- ``Publisher`` (publishing.py): sharing and publishing a step, with its delta, and announcing it;
- ``Fetcher`` (fetching.py): fetching a version by id, and following the trainer's versions;
- here: hearing announcements, finishing and dropping versions, and restoring after a restart.

Only manifests whose envelope the run's trainer signed are accepted (``fetch`` by id also accepts an
id-pinned manifest when no trainer is configured). The trainer announces each version on the gossip
topic ``CHECKPOINTS_TOPIC`` (protocol/topics.py), the signed manifest inside when it fits, else its id;
with ``follow`` a node fetches every trainer-signed version it hears of by itself, newest first, and
keeps the newest ``keep`` complete versions (K = async level + 1). A restarted node re-serves complete
versions and resumes unfinished ones from their verified pieces.

Deltas (docs/weight-swarm.md, "Deltas"): ``publish`` seeds the full version of a step and, given a held
base, may announce a delta version instead (publishing.py). A peer given a delta (followed, or ``fetch``
of its id) rebuilds the full version from a full version it holds, through a chain of known deltas if
need be, checks it piece by piece against the target's own signed manifest and then holds and serves
that full version; when no chain reaches a held version, or a delta does not rebuild the target
(``bad_delta``), it fetches the full version instead. Which way, and which obtain builds which version,
is the sans-IO planner's (protocol/swarm/rebuild.py); ``DeltaChain`` (delta_chain.py) carries its plans
out. ``locate``, ``newest`` and ``wait_newer`` only ever name full directories.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
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
from prime_node.swarm.delta_chain import DeltaChain
from prime_node.swarm.fetching import Fetcher, FetchHooks
from prime_node.swarm.holdings import Holdings
from prime_node.swarm.neighbours import MAX_NEIGHBOURS, keep_neighbours
from prime_node.swarm.publishing import Publisher, PublishHooks
from prime_node.swarm.store_layout import StoreLayout
from prime_node.swarm.transfer import OriginDirectory
from prime_node.swarm.version_exchange import ExchangeHooks, VersionExchange
from prime_node.swarm.versions import Version
from protocol.codec import decode
from protocol.envelope import Envelope
from protocol.errors import RemoteProtocolError
from protocol.manifest import Manifest, open_manifest
from protocol.peer_record import peer_id_of
from protocol.scoring import Offence
from protocol.swarm.catalogue import Catalogue, CatalogueAction
from protocol.swarm.messages import Announce
from protocol.topics import CHECKPOINTS_TOPIC

log = logging.getLogger(__name__)

STATUS_SECTION = "checkpoints"
TICK = 0.25
"""Seconds between ticks: request timeouts, super-seeding deadlines (as short as 0.25 s), expiring waits."""


@dataclass(frozen=True)
class SwarmSettings:
    """How a node takes part in the weight swarm: where its data plane listens, how many complete
    versions it keeps (``keep``), whether it follows the trainer's new versions (``follow``) and serves
    pieces to others (``upload``), at most how many data-plane neighbours it holds, and the seed of its
    random choices (tests)."""

    dataplane_host: str = "0.0.0.0"
    dataplane_port: int = 0
    keep: int = 2
    follow: bool = True
    upload: bool = True
    max_neighbours: int = MAX_NEIGHBOURS
    seed: int | None = None


class SwarmService:
    """See the module doc. Start it as a node service; the public API is ``share``, ``publish``,
    ``fetch``, ``locate``, ``newest``, ``wait_newer``, ``wait_changed``, ``progress`` and ``status``."""

    def __init__(
        self,
        *,
        key: WalletKey,
        run_id: str,
        trainer: Address | None,
        store_dir: Path,
        settings: SwarmSettings | None = None,
        transport: StreamTransport = TCP,
    ) -> None:
        settings = settings or SwarmSettings()
        dataplane_host, dataplane_port, keep = settings.dataplane_host, settings.dataplane_port, settings.keep
        follow, upload, max_neighbours, seed = (
            settings.follow,
            settings.upload,
            settings.max_neighbours,
            settings.seed,
        )
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
            hooks=ExchangeHooks(follow=self._start_following, drop=self._on_drop, offence=self._offence),
            transport=transport,
        )
        self.dataplane = self.exchange.dataplane
        self._context: NodeContext | None = None
        self._nursery: trio.Nursery | None = None
        self._port: int | None = None
        self.chain = DeltaChain(
            self.holdings,
            self.layout,
            start_fetch=self._start_fetch,
            get_manifest=self.get_manifest,
            hold=self._hold,
            drop=partial(self._drop_version, delete=True),
            retain=lambda: self.exchange.apply(self.catalogue.retain()),
        )
        self.publisher = Publisher(
            key,
            run_id,
            self.holdings,
            self.layout,
            PublishHooks(
                trainer=lambda: self.trainer,
                hold=self._hold,
                retain=lambda: self.exchange.apply(self.catalogue.retain()),
                context=lambda: self.context,
                nursery=lambda: self.nursery,
            ),
        )
        self.publish = self.publisher.publish
        """Share a step's directory, with its delta (publishing.py: ``Publisher.publish``)."""
        self.fetcher = Fetcher(
            self.holdings,
            self.catalogue,
            self.chain,
            run_id,
            FetchHooks(
                trainer=lambda: self.trainer,
                hold=self._hold,
                finish=self._finish,
                get_manifest=self.get_manifest,
                nursery=lambda: self.nursery,
            ),
        )
        self.fetch = self.fetcher.fetch
        """Fetch a version by id (fetching.py: ``Fetcher.fetch``)."""
        self.delta_bytes_in = 0

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
                self.dataplane.attach(context.host)  # the libp2p fallback for peers TCP cannot reach
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
        return (await self.publisher.publish(directory, step=step, piece_size=piece_size)).full

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
            "reconstructions": self.chain.reconstructions,
            "delta_bytes_in": self.delta_bytes_in,
            "bad_deltas": self.chain.bad_deltas,
            "fallback_peers": sum(link.fallback for link in self.dataplane.links.values()),
            "by_peer": self.dataplane.traffic.status(),
            **self.dataplane.stats.status(),
        }

    # --- versions -------------------------------------------------------------------------------------

    def _hold(self, version: Version) -> Version:
        """Tell the catalogue about a version just added to the holdings (it offers it to neighbours)."""
        complete, manifest = version.path is not None, version.manifest
        self.exchange.apply(
            self.catalogue.add_version(
                manifest.id(), version.step, complete=complete, base=manifest.base, target=manifest.target
            )
        )
        return version

    # The exchange and the delta chain are built before the fetcher: these reach it late-bound.

    def _start_following(self, mid: bytes) -> None:
        self.fetcher.start_following(mid)

    async def _start_fetch(self, manifest: Manifest, envelope: Envelope, out: Path | None) -> Version:
        return await self.fetcher.start_fetch(manifest, envelope, out)

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
        if version.manifest.is_delta:
            resumed = min(version.resumed_pieces * version.manifest.piece_size, version.manifest.total_size)
            self.delta_bytes_in += version.manifest.total_size - resumed
        if mid in self.catalogue.versions:
            self.exchange.apply(self.catalogue.version_complete(mid))
        self.holdings.notify()

    def _on_drop(self, mid: bytes) -> None:
        version = self.versions.get(mid)
        if version is not None:
            log.info("dropping step %d (keeping the newest %d)", version.step, self.keep)
            # An origin's own directory is the caller's; a delta the trainer encoded is the store's.
            self._drop_version(version, delete=not version.origin or version.manifest.is_delta)

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
                self.holdings.learn(mid, envelope, manifest)
                follows += self.catalogue.heard_of(mid, manifest.step, self.clock.now(), have_manifest=True)
        self.exchange.apply(self.catalogue.retain())
        for version in list(self.versions.values()):  # deltas whose target is not here
            manifest = version.manifest
            if manifest.is_delta and self.holdings.full(manifest.target) is None:
                if self.follow and manifest.signer != self.key.address:
                    self.fetcher.follow_via_delta(manifest)  # a rebuild a restart interrupted
                else:  # not following, or our own (a trainer's): its target was the trainer's directory
                    self._drop_version(version, delete=True)
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
                manifest = open_manifest(envelope, trainer=self.trainer, run=self.run_id, expected_id=mid)
                self.holdings.learn(mid, envelope, manifest)
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
