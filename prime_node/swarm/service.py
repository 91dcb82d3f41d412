"""The weight swarm as a node service: share, announce, discover, fetch and re-serve checkpoints.

One ``CheckpointTransfer`` per version, all over one data plane (prime_node/swarm/transport.py): every
frame names its manifest id and is routed to that version's transfer. On a channel, each side sends an
``Offer`` for every version it holds or fetches; a version's session between two peers starts when both
have offered it, so both bitfields arrive after both sides are ready. A peer that lacks a manifest asks
for it with ``ManifestRequest``; only manifests whose envelope the run's trainer signed are accepted
(``fetch`` by id also accepts an id-pinned manifest when no trainer is configured).

The trainer announces each version on the gossip topic ``checkpoints`` (the signed manifest inside when it
fits, else its id); with ``follow`` a node fetches every trainer-signed version it hears of by itself,
newest first, and keeps the newest ``keep`` complete versions (K = async level + 1).

On disk, under ``store_dir``: ``manifests/<id>.envelope`` (the signed manifest), ``pieces/<id>/`` (a
PieceStore while fetching) and ``checkpoints/step-<step>-<id>/`` (the complete directory; once it exists
the pieces are deleted and the version is served from the directory's files). A restarted node re-serves
complete versions and resumes unfinished ones from their verified pieces.
"""

from __future__ import annotations

import logging
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from crypto.digests import blake3
from crypto.identity import address_from_peer_id
from crypto.keys import Address, WalletKey
from prime_node.errors import NodeError
from prime_node.node.gossip import Delivered
from prime_node.swarm.checkpoint import build_checkpoint, node_error_from_os
from prime_node.swarm.piece_store import PieceStore
from prime_node.swarm.transfer import CheckpointTransfer, OriginDirectory, PieceSource
from prime_node.swarm.transport import DataPlane
from protocol.codec import Message, decode, decode_any, encode
from protocol.envelope import Envelope
from protocol.errors import RemoteProtocolError
from protocol.manifest import Manifest, open_manifest
from protocol.scoring import Offence
from protocol.swarm.messages import (
    MAX_ANNOUNCED_ENVELOPE_BYTES,
    Announce,
    ManifestEnvelope,
    ManifestRequest,
    Offer,
    Piece,
    Reject,
    Request,
)
from protocol.swarm.node import SwarmConfig

if TYPE_CHECKING:
    from prime_node.node.service import Node

log = logging.getLogger(__name__)

TOPIC = "checkpoints"
STATUS_SECTION = "checkpoints"
MAX_NEIGHBOURS = 12
MAX_TRACKED_OFFERS = 256
AVAILABILITY_BINS = 64
TICK = 1.0
NOT_BANNED_FOR = ("unresponsive", "banned")


@dataclass
class Version:
    """One checkpoint version this node holds, seeds or fetches."""

    manifest: Manifest
    envelope: Envelope
    transfer: CheckpointTransfer
    store: PieceStore | None
    path: Path | None
    origin: bool
    resumed_pieces: int = 0
    target: Path | None = None
    """Where a fetched version is to be written (None: inside the store)."""
    offered_to: set[Address] = field(default_factory=set)
    offered_by: set[Address] = field(default_factory=set)
    done: trio.Event = field(default_factory=trio.Event)
    error: NodeError | None = None

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def state(self) -> str:
        if self.origin:
            return "seeding"
        return "complete" if self.path is not None else "fetching"


@dataclass
class ManifestWait:
    """A manifest asked of peers: who was asked, and the outcome."""

    asked: set[Address] = field(default_factory=set)
    found: trio.Event = field(default_factory=trio.Event)
    result: tuple[Envelope, Manifest] | None = None
    error: NodeError | None = None


class SwarmService:
    """See the module doc. Start it as a node service; the public API is ``share``, ``fetch``,
    ``locate``, ``newest``, ``wait_newer`` and ``progress``."""

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
    ) -> None:
        if keep < 1:
            raise NodeError("keep must be at least 1", reason="bad_config")
        self.key = key
        self.run_id = run_id
        self.trainer = trainer
        self.store_dir = store_dir
        self.dataplane_host = dataplane_host
        self.dataplane_port = dataplane_port
        self.keep = keep
        self.follow = follow
        self.upload = upload
        self.max_neighbours = max_neighbours
        self.rng = random.Random(seed)
        self.versions: dict[bytes, Version] = {}
        self.offers: dict[bytes, dict[Address, int]] = {}
        self.waits: dict[bytes, ManifestWait] = {}
        self.known: dict[bytes, Envelope] = {}
        self.following: set[bytes] = set()
        self.changed = trio.Event()
        self.dataplane = DataPlane(key, on_up=self._on_up, on_frame=self._on_frame, on_down=self._on_down)
        self._node: Node | None = None
        self._nursery: trio.Nursery | None = None

    # --- lifecycle ------------------------------------------------------------------------------------

    async def run(self, node: Node, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._node = node
        try:
            for sub in ("manifests", "pieces", "checkpoints"):
                (self.store_dir / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise node_error_from_os(exc, f"preparing {self.store_dir}") from exc
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                port = await nursery.start(self.dataplane.run, self.dataplane_host, self.dataplane_port)
                node.dataplane_port = port  # before Node.run starts heartbeating: peers learn it at once
                await node.gossip.subscribe(TOPIC, self._on_announce)
                node.status_sections[STATUS_SECTION] = self.status
                self._restore()
                nursery.start_soon(self._tick_loop)
                nursery.start_soon(self._neighbour_loop)
                task_status.started()
                await trio.sleep_forever()
        finally:
            for version in self.versions.values():
                if version.store is not None:
                    version.store.close()

    @property
    def node(self) -> Node:
        if self._node is None:
            raise NodeError("the swarm service is not running", reason="not_running")
        return self._node

    @property
    def nursery(self) -> trio.Nursery:
        if self._nursery is None:
            raise NodeError("the swarm service is not running", reason="not_running")
        return self._nursery

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
        shared = await trio.to_thread.run_sync(
            lambda: build_checkpoint(
                directory,
                self.key,
                run=self.run_id,
                step=step,
                now_ms=int(time.time() * 1000),
                piece_size=piece_size,
            )
        )
        manifest, envelope = shared.manifest, shared.envelope
        mid = manifest.id()
        if mid not in self.versions:
            source = OriginDirectory(directory, manifest)
            self._add_version(manifest, envelope, source, store=None, path=directory, origin=True)
        payload = encode(envelope)
        announce = Announce(
            mid, self.run_id, step, payload if len(payload) <= MAX_ANNOUNCED_ENVELOPE_BYTES else b""
        )
        try:
            await self.node.gossip.publish(TOPIC, encode(announce))
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

    def locate(self, step: int) -> Path | None:
        """The complete, verified directory of ``step``, if held."""
        for version in self.versions.values():
            if version.step == step and version.path is not None and version.done.is_set():
                return version.path
        return None

    def newest(self) -> tuple[int, Path] | None:
        held = [(v.step, v.path) for v in self.versions.values() if v.path is not None and v.done.is_set()]
        return max(held, key=lambda item: item[0]) if held else None

    async def wait_newer(self, than: int | None) -> tuple[int, Path]:
        """Wait until a complete checkpoint with a step above ``than`` (any, if None) is held."""
        while True:
            newest = self.newest()
            if newest is not None and (than is None or newest[0] > than):
                return newest
            await self.changed.wait()

    async def wait_changed(self) -> None:
        """Return at the next change of the held versions (one completed, dropped or added)."""
        await self.changed.wait()

    def progress(self, manifest_id: bytes) -> tuple[int, int] | None:
        """(pieces held, piece count) of a version, or None if unknown."""
        version = self.versions.get(manifest_id)
        if version is None:
            return None
        return version.transfer.node.have.bit_count(), version.manifest.piece_count

    def resumed_pieces(self, manifest_id: bytes) -> int:
        version = self.versions.get(manifest_id)
        return version.resumed_pieces if version is not None else 0

    def status(self) -> dict[str, Any]:
        versions = sorted(self.versions.values(), key=lambda v: v.step, reverse=True)
        return {
            "versions": [
                {
                    "step": v.step,
                    "manifest_id": v.manifest.id().hex(),
                    "pieces": v.manifest.piece_count,
                    "have": v.transfer.node.have.bit_count(),
                    "state": v.state,
                    "availability": availability(v),
                }
                for v in versions
            ],
            "bytes_in": self.dataplane.bytes_in,
            "bytes_out": self.dataplane.bytes_out,
            "peers": len(self.dataplane.links),
        }

    # --- versions -------------------------------------------------------------------------------------

    def _add_version(
        self,
        manifest: Manifest,
        envelope: Envelope,
        source: PieceSource,
        *,
        store: PieceStore | None,
        path: Path | None,
        origin: bool,
    ) -> Version:
        mid = manifest.id()
        holder: list[Version] = []
        transfer = CheckpointTransfer(
            manifest,
            source,
            send=self.dataplane.send,  # type: ignore[arg-type]
            close=self._on_transfer_close,  # type: ignore[arg-type]
            rng=random.Random(self.rng.getrandbits(64)),
            config=SwarmConfig(super_seed=origin),
            on_complete=lambda: self._on_complete(holder[0]),
            upload=self.upload,
        )
        version = Version(manifest, envelope, transfer, store, path, origin)
        holder.append(version)
        self.versions[mid] = version
        self.known[mid] = envelope
        if path is not None:
            version.done.set()
            self._changed()
        for peer in list(self.dataplane.links):
            self._offer(version, peer)
        for peer in self.offers.pop(mid, {}):
            self._on_offer_from(version, peer)
        return version

    def _start_fetch(self, manifest: Manifest, envelope: Envelope, out: Path | None) -> Version:
        mid = manifest.id()
        store = PieceStore.open(self.store_dir / "pieces", manifest)
        try:
            _write_atomically(self.store_dir / "manifests" / f"{mid.hex()}.envelope", encode(envelope))
        except OSError as exc:
            store.close()
            raise node_error_from_os(exc, f"writing to {self.store_dir}") from exc
        version = self._add_version(manifest, envelope, store, store=store, path=None, origin=False)
        version.resumed_pieces = store.piece_count_held
        version.target = out
        log.info(
            "fetching step %d (%s): %d of %d pieces already verified on disk",
            manifest.step,
            mid.hex()[:16],
            store.piece_count_held,
            manifest.piece_count,
        )
        if store.complete:
            self.nursery.start_soon(self._finish, version)
        return version

    def _on_complete(self, version: Version) -> None:
        if not version.origin and version.path is None:
            self.nursery.start_soon(self._finish, version)

    async def _finish(self, version: Version) -> None:
        """Write the complete directory atomically, then serve from it and drop the pieces."""
        store = version.store
        if store is None or version.done.is_set():
            return
        mid = version.manifest.id()
        out = version.target
        target = out if out is not None else self._checkpoint_dir(version.manifest)
        try:
            if out is None and target.exists():
                shutil.rmtree(target)  # our own leftover from a run killed between rename and cleanup
            await trio.to_thread.run_sync(store.materialize, target)
        except NodeError as exc:
            log.warning("cannot write step %d: %s", version.step, exc)
            version.error = exc
            self._drop_version(version, delete=False)
            version.done.set()
            return
        store.close()
        store.remove()
        if out is not None:
            (self.store_dir / "manifests" / f"{mid.hex()}.envelope").unlink(missing_ok=True)
        version.transfer.pieces = OriginDirectory(target, version.manifest)
        version.store = None
        version.path = target
        version.done.set()
        log.info("step %d complete: %s", version.step, target)
        self._retain()
        self._changed()

    def _checkpoint_dir(self, manifest: Manifest) -> Path:
        return self.store_dir / "checkpoints" / f"step-{manifest.step}-{manifest.id().hex()[:16]}"

    def _retain(self) -> None:
        """Keep the newest ``keep`` complete versions; older ones are forgotten (and deleted if ours)."""
        complete = sorted(
            (v for v in self.versions.values() if v.path is not None), key=lambda v: v.step, reverse=True
        )
        for version in complete[self.keep :]:
            log.info("dropping step %d (keeping the newest %d)", version.step, self.keep)
            self._drop_version(version, delete=not version.origin)

    def _drop_version(self, version: Version, *, delete: bool) -> None:
        mid = version.manifest.id()
        self.versions.pop(mid, None)
        now = trio.current_time()
        for peer in list(version.transfer.node.peers):
            version.transfer.disconnected(peer, now)
        if version.store is not None:
            version.store.close()
        if delete and version.path is not None and version.path.is_relative_to(self.store_dir):
            shutil.rmtree(version.path, ignore_errors=True)
            (self.store_dir / "manifests" / f"{mid.hex()}.envelope").unlink(missing_ok=True)
        self._changed()

    def _changed(self) -> None:
        if self._node is not None:
            steps = sorted({v.step for v in self.versions.values() if v.path is not None}, reverse=True)
            self._node.versions_held = tuple(steps[:16])
        self.changed.set()
        self.changed = trio.Event()

    def _restore(self) -> None:
        """Re-serve complete versions found on disk; resume unfinished ones (when following)."""
        for path in sorted((self.store_dir / "manifests").glob("*.envelope")):
            try:
                mid = bytes.fromhex(path.name.removesuffix(".envelope"))
                envelope = decode(path.read_bytes(), Envelope)
                manifest = open_manifest(envelope, trainer=self.trainer or envelope.signer, expected_id=mid)
            except (ValueError, OSError, RemoteProtocolError) as exc:
                log.warning("ignoring %s: %s", path, exc)
                continue
            directory = self._checkpoint_dir(manifest)
            if directory.is_dir():
                source = OriginDirectory(directory, manifest)
                self._add_version(manifest, envelope, source, store=None, path=directory, origin=False)
            elif self.follow and (self.store_dir / "pieces" / mid.hex()).is_dir():
                self.known[mid] = envelope
                self._follow(mid, manifest.step)
        self._retain()

    # --- manifests ------------------------------------------------------------------------------------

    async def get_manifest(self, mid: bytes) -> tuple[Envelope, Manifest]:
        """The signed manifest ``mid``, from memory or asked of every neighbour (waits until one answers;
        NodeError ``wrong_signer`` if it is not the trainer's)."""
        envelope = self.known.get(mid)
        if envelope is not None:
            return envelope, self._open(envelope, mid)
        wait = self.waits.get(mid)
        if wait is None:
            wait = self.waits[mid] = ManifestWait()
            for peer in list(self.dataplane.links):
                self._ask_manifest(wait, mid, peer)
        await wait.found.wait()
        self.waits.pop(mid, None)
        if wait.error is not None:
            raise wait.error
        assert wait.result is not None
        return wait.result

    def _open(self, envelope: Envelope, mid: bytes) -> Manifest:
        try:
            return open_manifest(envelope, trainer=self.trainer or envelope.signer, expected_id=mid)
        except RemoteProtocolError as exc:
            raise NodeError(f"refusing manifest {mid.hex()}: {exc}", reason=exc.reason) from exc

    def _ask_manifest(self, wait: ManifestWait, mid: bytes, peer: Address) -> None:
        if peer not in wait.asked:
            wait.asked.add(peer)
            self.dataplane.send(peer, encode(ManifestRequest(mid)))

    def _on_manifest(self, peer: Address, message: ManifestEnvelope) -> None:
        mid = message.manifest_id
        wait = self.waits.get(mid)
        if wait is None or wait.found.is_set():
            return
        try:
            envelope = decode(message.envelope, Envelope)
            if blake3(envelope.payload) != mid:
                raise RemoteProtocolError(
                    "manifest does not have the requested id", reason="wrong_manifest_id"
                )
            manifest = open_manifest(envelope, trainer=self.trainer or envelope.signer, expected_id=mid)
        except RemoteProtocolError as exc:
            if exc.reason == "wrong_signer":
                # The id pins this manifest, so its sender is honest: the id is not the trainer's.
                wait.error = NodeError(f"refusing checkpoint {mid.hex()}: {exc}", reason="wrong_signer")
                wait.found.set()
                return
            self._ban(peer, f"bad manifest: {exc.reason}")
            return
        self.known[mid] = envelope
        wait.result = (envelope, manifest)
        wait.found.set()

    # --- following ------------------------------------------------------------------------------------

    async def _on_announce(self, message: Delivered) -> None:
        if self.trainer is None or message.origin != self.trainer:
            log.debug("ignoring a checkpoint announcement from %s (not the trainer)", message.origin)
            return
        try:
            announce = decode(message.payload, Announce)
            if announce.envelope and announce.manifest_id not in self.known:
                envelope = decode(announce.envelope, Envelope)
                open_manifest(
                    envelope, trainer=self.trainer, run=self.run_id, expected_id=announce.manifest_id
                )
                self.known[announce.manifest_id] = envelope
        except RemoteProtocolError as exc:
            log.warning("ignoring a malformed checkpoint announcement: %s", exc)
            return
        if announce.run == self.run_id:
            self._follow(announce.manifest_id, announce.step)

    def _follow(self, mid: bytes, step: int) -> None:
        """With ``follow``, fetch a version we heard of unless we already have newer ones to keep."""
        if not self.follow or self.trainer is None or mid in self.versions or mid in self.following:
            return
        held = sorted((v.step for v in self.versions.values()), reverse=True)
        if len(held) >= self.keep and step <= held[self.keep - 1]:
            return
        self.following.add(mid)
        self.nursery.start_soon(self._follow_task, mid)

    async def _follow_task(self, mid: bytes) -> None:
        try:
            _, manifest = await self.get_manifest(mid)
            if manifest.run != self.run_id:
                log.warning("not following %s: it belongs to run %s", mid.hex()[:16], manifest.run)
                return
            await self.fetch(mid)
        except NodeError as exc:
            log.warning("could not fetch checkpoint %s: %s", mid.hex()[:16], exc)
        finally:
            self.following.discard(mid)

    # --- data plane events ----------------------------------------------------------------------------

    def _on_up(self, peer: Address) -> None:
        for version in list(self.versions.values()):
            self._offer(version, peer)
        for mid, wait in self.waits.items():
            if not wait.found.is_set():
                self._ask_manifest(wait, mid, peer)

    def _on_down(self, peer: Address) -> None:
        now = trio.current_time()
        for version in list(self.versions.values()):
            version.offered_to.discard(peer)
            version.offered_by.discard(peer)
            version.transfer.disconnected(peer, now)
        for holders in self.offers.values():
            holders.pop(peer, None)
        for wait in self.waits.values():
            wait.asked.discard(peer)

    def _on_frame(self, peer: Address, frame: bytes) -> None:
        try:
            message = decode_any(frame, max_bytes=max(Piece.MAX_BYTES, ManifestEnvelope.MAX_BYTES))
        except RemoteProtocolError as exc:
            self._ban(peer, f"undecodable frame ({exc.reason})")
            return
        mid = getattr(message, "manifest_id", None)
        if not isinstance(mid, bytes):
            self._ban(peer, f"unexpected {message.TYPE} on the data plane")
            return
        if isinstance(message, Offer):
            self._on_offer(peer, message)
        elif isinstance(message, ManifestRequest):
            envelope = self.known.get(mid)
            if envelope is not None and mid in self.versions:
                self.dataplane.send(peer, encode(ManifestEnvelope(mid, encode(envelope))))
        elif isinstance(message, ManifestEnvelope):
            self._on_manifest(peer, message)
        else:
            self._route(peer, mid, message)

    def _route(self, peer: Address, mid: bytes, message: Message) -> None:
        version = self.versions.get(mid)
        if version is not None:
            version.transfer.receive(peer, message, trio.current_time())
        elif isinstance(message, Request):
            self.dataplane.send(peer, encode(Reject(mid, message.index, "missing")))

    def _on_offer(self, peer: Address, message: Offer) -> None:
        version = self.versions.get(message.manifest_id)
        if version is not None:
            self._on_offer_from(version, peer)
            return
        holders = self.offers.setdefault(message.manifest_id, {})
        if len(self.offers) > MAX_TRACKED_OFFERS:
            self.offers.pop(next(iter(self.offers)))
            holders = self.offers.setdefault(message.manifest_id, {})
        holders[peer] = message.step
        wait = self.waits.get(message.manifest_id)
        if wait is not None and not wait.found.is_set():
            wait.asked.discard(peer)  # asked before it held the version (no answer then); it does now
            self._ask_manifest(wait, message.manifest_id, peer)
        self._follow(message.manifest_id, message.step)

    def _on_offer_from(self, version: Version, peer: Address) -> None:
        version.offered_by.add(peer)
        if peer not in version.offered_to:
            self._offer(version, peer)
        else:
            version.transfer.connected(peer, trio.current_time())

    def _offer(self, version: Version, peer: Address) -> None:
        if peer in version.offered_to or peer not in self.dataplane.links:
            return
        version.offered_to.add(peer)
        self.dataplane.send(peer, encode(Offer(version.manifest.id(), version.step)))
        if peer in version.offered_by:
            version.transfer.connected(peer, trio.current_time())

    def _on_transfer_close(self, peer: Address, reason: str) -> None:
        if reason not in NOT_BANNED_FOR:
            self._ban(peer, reason)

    def _ban(self, peer: Address, reason: str) -> None:
        log.warning("banning %s from the weight swarm: %s", peer, reason)
        self.dataplane.ban(peer)
        node = self._node
        if node is None or not node.is_running:
            return
        for member in node.membership.members():
            if member.record.address == peer:
                node.policy.offence(member.peer_id, Offence.BAD_DATA, reason)
                break

    # --- background loops -----------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            await trio.sleep(TICK)
            now = trio.current_time()
            for version in list(self.versions.values()):
                version.transfer.tick(now)

    async def _neighbour_loop(self) -> None:
        """Keep up to ``max_neighbours`` channels to run members that advertise a data plane."""
        node = self.node
        while True:
            links = self.dataplane.links
            if len(links) + len(self.dataplane.dialing) < self.max_neighbours:
                candidates = []
                for member in node.membership.members():
                    record = member.record
                    if (
                        record.dataplane_port
                        and record.address != self.key.address
                        and record.address not in links
                        and record.address not in self.dataplane.banned
                        and not node.policy.is_banned(member.peer_id)
                    ):
                        host = dial_host(record.multiaddrs)
                        if host is not None:
                            candidates.append((record.address, host, record.dataplane_port, member.peer_id))
                self.rng.shuffle(candidates)
                room = self.max_neighbours - len(links) - len(self.dataplane.dialing)
                for address, host, port, peer_id in candidates[: max(room, 0)]:
                    if address_from_peer_id(peer_id) == address:
                        self.dataplane.dial(address, host, port)
            await trio.sleep(0.5 if len(links) < 2 else 2.0)


def dial_host(multiaddrs: tuple[str, ...]) -> str | None:
    """The first usable IPv4/IPv6/DNS host among a peer's multiaddrs."""
    for multiaddr in multiaddrs:
        parts = multiaddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6"):
            host = parts[2]
            if host not in ("0.0.0.0", "::"):
                return host
    return None


def availability(version: Version) -> list[int]:
    """Peers holding each piece, bucketed into at most AVAILABILITY_BINS bins (min over each bin)."""
    count = version.manifest.piece_count
    bits = list(version.transfer.node.picker.peer_bits.values())
    bins = min(AVAILABILITY_BINS, count)
    width = math.ceil(count / bins)
    result = []
    for start in range(0, count, width):
        end = min(start + width, count)
        mask = ((1 << (end - start)) - 1) << start
        if end - start <= 64:
            result.append(min(sum(1 for b in bits if b >> i & 1) for i in range(start, end)))
        else:  # wide bins (over 4,096 pieces): peers holding the whole bin, a lower bound of the minimum
            result.append(sum(1 for b in bits if b & mask == mask))
    return result


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    temporary.replace(path)
