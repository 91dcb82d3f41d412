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

Deltas (docs/weight-swarm.md, "Deltas"): ``publish`` always builds, signs and seeds the full version of a
step and, given the directory of a full version it holds as the base, also a delta version, encoded in
the background and announced instead of the full one when it is small enough and ready within
``DELTA_WAIT`` of it (else after it: a slow delta never delays a policy; docs/deltas.md). A peer given
a delta (followed, or ``fetch`` of its id) rebuilds the full version from a full version it holds,
through a chain of known deltas if need be, checks it piece by piece against the target's own signed
manifest and then holds and serves that full version; when no chain reaches a held version, or a delta
does not rebuild the target (``bad_delta``), it fetches the full version instead. Which way, and which
obtain builds which version, is the sans-IO planner's (protocol/swarm/rebuild.py); ``DeltaChain``
(delta_chain.py) carries its plans out. ``locate``, ``newest`` and ``wait_newer`` only ever name full
directories.
"""

from __future__ import annotations

import logging
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
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
from prime_node.swarm.checkpoint_pieces import SharedCheckpoint, build_checkpoint
from prime_node.swarm.delta_chain import DeltaChain
from prime_node.swarm.delta_versions import Published, encode_delta_version
from prime_node.swarm.holdings import Holdings
from prime_node.swarm.neighbours import MAX_NEIGHBOURS, keep_neighbours
from prime_node.swarm.store_layout import StoreLayout
from prime_node.swarm.transfer import OriginDirectory
from prime_node.swarm.version_exchange import ExchangeHooks, VersionExchange
from prime_node.swarm.versions import Version, open_known
from protocol.codec import decode, encode
from protocol.envelope import Envelope
from protocol.errors import RemoteProtocolError
from protocol.manifest import Manifest, open_manifest
from protocol.peer_record import peer_id_of
from protocol.scoring import Offence
from protocol.swarm.catalogue import Catalogue, CatalogueAction
from protocol.swarm.messages import MAX_ANNOUNCED_ENVELOPE_BYTES, Announce
from protocol.swarm.rebuild import Build
from protocol.topics import CHECKPOINTS_TOPIC

log = logging.getLogger(__name__)

STATUS_SECTION = "checkpoints"
TICK = 0.25
"""Seconds between ticks: request timeouts, super-seeding deadlines (as short as 0.25 s), expiring waits."""
FOLLOW_MANIFEST_WAIT = 60.0
"""How long following (or a delta) waits for a full version's manifest before giving up on it."""
DELTA_WAIT = 5.0
"""Seconds ``publish`` holds back a step's announcement for its delta once the full version is ready: a
peer that hears of the full version first fetches it whole, so a delta announced later only serves late
peers. A delta slower than this never delays the policy further (it is announced when it is ready)."""


@dataclass
class _DeltaJob:
    """A delta ``publish`` encodes in the background: the outcome, and who announces it."""

    done: trio.Event = field(default_factory=trio.Event)
    published: Published | None = None
    announced: SharedCheckpoint | None = None
    """The delta version, when one was kept."""
    late: bool = False
    """``publish`` stopped waiting and announced the full version: the job announces the delta itself."""


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
        self._encoding = trio.Lock()
        """Held while a delta is encoded: the encodes of successive steps take turns on the cores."""
        self._opening: dict[bytes, trio.Event] = {}
        """Versions whose piece store is being opened (in a worker thread): set when it is held, or not."""
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
        return (await self.publish(directory, step=step, piece_size=piece_size)).full

    async def publish(
        self,
        directory: Path,
        *,
        step: int,
        delta_base: Path | None = None,
        snapshot: bool = False,
        max_delta_share: float = 0.5,
        piece_size: int | None = None,
        delta_wait: float = DELTA_WAIT,
        on_delta: Callable[[Published], None] | None = None,
    ) -> Published:
        """Share ``directory`` as step ``step``: its full version is always hashed, signed and seeded.
        Unless ``snapshot``, when ``delta_base`` is the directory of a full version this service holds,
        a delta against it is encoded too, in the background; if it is at most ``max_delta_share`` of the
        full size it is signed, seeded and announced instead of the full version (peers without the base
        fetch that) when it is ready within ``delta_wait`` seconds of the full version. Otherwise the full
        version is announced then (reason ``encoding``) and the delta, once ready, announced after it
        (for peers that did not start on the full version yet), and ``on_delta`` gets its outcome."""
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
        full = shared.manifest
        mid = full.id()
        base = self._held_full_at(delta_base)
        reason = "snapshot" if snapshot else "no_base" if delta_base is None else "base_not_held"
        if not snapshot and base is not None and base.manifest.id() == mid:
            reason = "unchanged"
        elif not snapshot and base is not None:
            job = _DeltaJob()
            max_bytes = int(max_delta_share * full.total_size)
            self.nursery.start_soon(
                self._encode_delta, job, base, directory, shared, now_ms, max_bytes, on_delta
            )
            with trio.move_on_after(delta_wait):
                await job.done.wait()
            if job.published is not None:
                self._hold_origin(shared, directory)  # after the delta: neighbours are offered that first
                announced = job.announced if job.announced is not None else shared
                return await self._announce_published(job.published, announced)
            job.late = True
            reason = "encoding"
        self._hold_origin(shared, directory)
        return await self._announce_published(
            Published(
                full=full,
                delta=None,
                full_bytes=full.total_size,
                delta_bytes=0,
                encode_seconds=0.0,
                reason=reason,
            ),
            shared,
        )

    def _hold_origin(self, shared: SharedCheckpoint, directory: Path) -> None:
        """Seed the full version the trainer just built from its own directory."""
        if shared.manifest_id not in self.versions:
            source = OriginDirectory(directory, shared.manifest)
            self._hold(
                self.holdings.add(
                    shared.manifest, shared.envelope, source, store=None, path=directory, origin=True
                )
            )

    async def _announce_published(self, published: Published, announced: SharedCheckpoint) -> Published:
        """Announce ``announced`` (the delta of ``published``, or its full version) and log it."""
        await self._announce(announced.manifest, announced.envelope)
        self.exchange.apply(self.catalogue.retain())
        log.info(
            "sharing step %d as %s (%d pieces; %s%s)",
            published.full.step,
            announced.manifest_id.hex(),
            announced.manifest.piece_count,
            published.reason,
            f", {published.delta_bytes} of {published.full_bytes} bytes" if published.delta_bytes else "",
        )
        return published

    async def _encode_delta(
        self,
        job: _DeltaJob,
        base: Version,
        directory: Path,
        shared: SharedCheckpoint,
        now_ms: int,
        max_bytes: int,
        on_delta: Callable[[Published], None] | None,
    ) -> None:
        """Encode, sign and seed the delta of ``shared`` against ``base`` (one at a time: encodes share the
        cores), then hand it to ``publish`` or, if it stopped waiting, announce it here."""
        full = shared.manifest
        assert base.path is not None
        base_path, base_id = base.path, base.manifest.id()
        delta, delta_bytes, seconds, reason = None, 0, 0.0, "not_kept"
        try:
            async with self._encoding:
                delta, stats = await trio.to_thread.run_sync(
                    lambda: encode_delta_version(
                        base_path,
                        directory,
                        self.layout.checkpoints,
                        self.key,
                        full=full,
                        base_id=base_id,
                        now_ms=now_ms,
                        max_bytes=max_bytes,
                    )
                )
            delta_bytes, seconds = stats.delta_bytes, stats.seconds
            reason = "too_large" if delta is None else "delta"
        except NodeError as exc:  # e.g. the trainer removed a directory meanwhile: the full version stands
            log.warning("could not encode the delta of step %d: %s", full.step, exc)
        # Held (so offered) before it is announced: a neighbour hears of the delta first and takes it.
        if delta is not None and not self._hold_delta(delta.manifest, delta.envelope, delta.directory):
            delta, reason = None, "not_kept"
        published = Published(
            full=full,
            delta=delta.manifest if delta is not None else None,
            full_bytes=full.total_size,
            delta_bytes=delta_bytes,
            encode_seconds=seconds,
            reason=reason,
        )
        job.published, job.announced = published, delta
        job.done.set()
        if job.late:
            if delta is not None:
                await self._announce_published(published, delta)
            if on_delta is not None:
                on_delta(published)

    def _held_full_at(self, directory: Path | None) -> Version | None:
        if directory is None:
            return None
        wanted = directory.resolve()
        for version in self.versions.values():
            held = self.holdings.full(version.manifest.id())
            if held is not None and held.path is not None and held.path.resolve() == wanted:
                return held
        return None

    def _hold_delta(self, manifest: Manifest, envelope: Envelope, work: Path) -> bool:
        """Move a delta the trainer just encoded where the store keeps versions, and seed it (False: it
        could not be kept, and is gone)."""
        mid = manifest.id()
        if mid in self.versions:
            shutil.rmtree(work, ignore_errors=True)
            return True
        directory = self.layout.checkpoint_dir(manifest)
        try:
            shutil.rmtree(directory, ignore_errors=True)
            work.rename(directory)
            self.layout.save_envelope(mid, envelope)
        except (OSError, NodeError) as exc:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(directory, ignore_errors=True)
            log.warning(
                "cannot keep the delta of step %d (announcing the full version): %s", manifest.step, exc
            )
            return False
        source = OriginDirectory(directory, manifest)
        self._hold(self.holdings.add(manifest, envelope, source, store=None, path=directory, origin=True))
        return True

    async def _announce(self, manifest: Manifest, envelope: Envelope) -> None:
        payload = encode(envelope)
        announce = Announce(
            manifest.id(),
            self.run_id,
            manifest.step,
            payload if len(payload) <= MAX_ANNOUNCED_ENVELOPE_BYTES else b"",
        )
        try:
            await self.context.gossip.publish(CHECKPOINTS_TOPIC, encode(announce))
        except NodeError as exc:
            log.info("checkpoint announcement not gossiped (peers will still learn it on connect): %s", exc)

    async def fetch(self, manifest_id: bytes, *, out: Path | None = None) -> Path:
        """Download the version ``manifest_id`` from peers, verify it and return its complete directory
        (``out`` if given, written atomically; else inside the store). Resumes from verified pieces.
        For a delta's id, the full directory it produces: rebuilt from a held base (or a chain), else
        fetched whole."""
        version = self.versions.get(manifest_id)
        if version is None:
            envelope, manifest = await self.get_manifest(manifest_id)
            if manifest.is_delta:
                return await self.chain.fetch(manifest, out)
            version = self.versions.get(manifest_id)
            if version is None:
                version = await self._start_fetch(manifest, envelope, out)
        elif version.manifest.is_delta:
            return await self.chain.fetch(version.manifest, out)
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

    async def _start_fetch(self, manifest: Manifest, envelope: Envelope, out: Path | None) -> Version:
        """Hold ``manifest``'s version and fetch it (``Holdings.start_fetch``); a caller that comes while
        its store is being opened gets the same version (``out`` is the first caller's)."""
        mid = manifest.id()
        while (opening := self._opening.get(mid)) is not None:
            await opening.wait()
        held = self.versions.get(mid)
        if held is not None:
            return held
        opened = self._opening[mid] = trio.Event()
        try:
            version = self._hold(await self.holdings.start_fetch(manifest, envelope, out))
        finally:
            del self._opening[mid]
            opened.set()
        if version.store is not None and version.store.complete:
            self.nursery.start_soon(self._finish, version)
        return version

    async def _follow_full(self, manifest: Manifest, envelope: Envelope) -> None:
        try:
            await self._start_fetch(manifest, envelope, None)
        except NodeError as exc:
            log.warning("could not fetch checkpoint %s: %s", manifest.id().hex()[:16], exc)
            self.catalogue.follow_ended(manifest.id())

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
            elif manifest.is_delta or self.holdings.delta_to(mid) is not None or self.chain.in_flight(mid):
                self._follow_via_delta(manifest)
            elif mid not in self.versions and mid not in self._opening:
                self.nursery.start_soon(self._follow_full, manifest, envelope)
        except NodeError as exc:
            log.warning("could not fetch checkpoint %s: %s", mid.hex()[:16], exc)
            self.catalogue.follow_ended(mid)

    def _follow_via_delta(self, manifest: Manifest) -> None:
        """A followed delta, or a followed full version a known delta produces: obtain the full version
        through the delta (or its fallback) unless it is held or on its way already."""
        delta = manifest if manifest.is_delta else self.holdings.delta_to(manifest.id())
        target = manifest.target if manifest.is_delta else manifest.id()
        if delta is None or target in self.versions or self.chain.in_flight(target):
            self.catalogue.follow_ended(manifest.id())
            return
        build = self.chain.claim(target, delta)  # claimed now: the task starts later
        self.nursery.start_soon(self._follow_delta, delta, build)

    async def _follow_delta(self, delta: Manifest, build: Build[Manifest]) -> None:
        try:
            await self.chain.obtain(build, out=None, wait=FOLLOW_MANIFEST_WAIT)
        except NodeError as exc:
            log.warning("could not obtain step %d (%s): %s", delta.step, build.target.hex()[:16], exc)
        finally:
            for mid in (delta.id(), build.target):
                if mid not in self.versions:
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
                    self._follow_via_delta(manifest)  # a rebuild a restart interrupted
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
