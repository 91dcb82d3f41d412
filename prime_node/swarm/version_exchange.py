"""The data-plane side of the weight swarm: what neighbours say goes to the catalogue
(protocol/swarm/catalogue.py) or to a version's transfer, and the catalogue's actions go out as frames.

On a channel, each side sends an ``Offer`` for every version it holds or fetches; a version's session
between two peers starts when both have offered it, so both bitfields arrive after both sides are ready.
A peer that lacks a manifest asks for it with ``ManifestRequest``. A peer that sends an undecodable
frame, a message that has no place on the data plane or a manifest that is not what it claims is banned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from crypto.keys import Address, WalletKey
from prime_node.dataplane.streams import TCP, StreamTransport
from prime_node.errors import NodeError
from prime_node.swarm.holdings import Holdings
from prime_node.swarm.transfer import decode_frame
from prime_node.swarm.transport import DataPlane
from prime_node.swarm.versions import ManifestWait, open_known, open_sent
from protocol.codec import encode
from protocol.dataplane import Frame
from protocol.envelope import Envelope
from protocol.errors import RemoteProtocolError
from protocol.manifest import Manifest
from protocol.swarm.catalogue import (
    AskManifest,
    Catalogue,
    CatalogueAction,
    CloseSession,
    Drop,
    GiveUp,
    OpenSession,
    SendManifest,
    SendOffer,
    StartFetch,
)
from protocol.swarm.messages import ManifestEnvelope, ManifestRequest, Offer, Piece, Reject, Request

log = logging.getLogger(__name__)

NOT_BANNED_FOR = ("unresponsive", "banned")
"""Transfer close reasons that are no offence (a slow or already banned peer)."""


@dataclass(frozen=True)
class ExchangeHooks:
    """What the exchange tells its swarm service: ``follow`` starts a followed version's fetch, ``drop``
    forgets a version retention dropped, ``offence`` reports a banned peer to the node's peer policy."""

    follow: Callable[[bytes], None]
    drop: Callable[[bytes], None]
    offence: Callable[[Address, str], None]


class VersionExchange:
    """See the module doc. ``trainer`` gives the run's trainer (it may change); ``hooks`` reach back into
    the swarm service; ``transport`` is where the data plane's streams come from."""

    def __init__(
        self,
        key: WalletKey,
        catalogue: Catalogue[Address],
        holdings: Holdings,
        *,
        now: Callable[[], float],
        trainer: Callable[[], Address | None],
        hooks: ExchangeHooks,
        transport: StreamTransport = TCP,
    ) -> None:
        self.catalogue = catalogue
        self.holdings = holdings
        self.now = now
        self.trainer = trainer
        self.on_follow = hooks.follow
        self.on_drop = hooks.drop
        self.on_offence = hooks.offence
        self.waits: dict[bytes, ManifestWait] = {}
        self.dataplane = DataPlane(
            key, on_up=self.on_up, on_frame=self.on_frame, on_down=self.on_down, transport=transport
        )

    async def get_manifest(self, mid: bytes) -> tuple[Envelope, Manifest]:
        """The signed manifest ``mid``, from memory or asked of every neighbour (waits until one answers;
        NodeError ``wrong_signer`` if it is not the trainer's)."""
        envelope = self.holdings.known.get(mid)
        if envelope is not None:
            return envelope, open_known(envelope, mid, self.trainer())
        wait = self.waits.setdefault(mid, ManifestWait())
        self.apply(self.catalogue.request_manifest(mid, self.now(), patient=True))
        try:
            await wait.found.wait()
        finally:
            if not wait.found.is_set():  # cancelled: this caller no longer waits
                self.catalogue.release_manifest(mid)
                if mid not in self.catalogue.pending:
                    self.waits.pop(mid, None)
        self.waits.pop(mid, None)
        if wait.error is not None:
            raise wait.error
        assert wait.result is not None
        return wait.result

    # --- data plane events ----------------------------------------------------------------------------

    def on_up(self, peer: Address) -> None:
        self.apply(self.catalogue.peer_up(peer, self.now()))

    def on_down(self, peer: Address) -> None:
        self.apply(self.catalogue.peer_down(peer))

    def on_frame(self, peer: Address, frame: Frame) -> None:
        try:
            # Pieces (almost every byte) and haves (most frames) skip the general codec.
            message, digest = decode_frame(frame, max(Piece.MAX_BYTES, ManifestEnvelope.MAX_BYTES))
        except RemoteProtocolError as exc:
            self.ban(peer, f"undecodable frame ({exc.reason})")
            return
        mid = getattr(message, "manifest_id", None)
        if not isinstance(mid, bytes):
            self.ban(peer, f"unexpected {message.TYPE} on the data plane")
            return
        if isinstance(message, Offer):
            known = mid in self.holdings.known
            self.apply(
                self.catalogue.offer_received(peer, mid, message.step, self.now(), have_manifest=known)
            )
        elif isinstance(message, ManifestRequest):
            self.apply(self.catalogue.manifest_requested(peer, mid))
        elif isinstance(message, ManifestEnvelope):
            self._on_manifest(peer, message)
        elif (version := self.holdings.versions.get(mid)) is not None:
            version.transfer.receive(peer, message, self.now(), digest=digest)
        elif isinstance(message, Request):
            self.dataplane.send(peer, encode(Reject(mid, message.index, "missing")))

    def _on_manifest(self, peer: Address, message: ManifestEnvelope) -> None:
        mid = message.manifest_id
        if mid not in self.catalogue.pending:
            return  # not asked for, or already answered
        wait = self.waits.get(mid)
        try:
            envelope, manifest = open_sent(message, self.trainer())
        except RemoteProtocolError as exc:
            if exc.reason != "wrong_signer":
                self.ban(peer, f"bad manifest: {exc.reason}")
                return
            # The id pins this manifest, so its sender is honest: the id is not the trainer's.
            error = NodeError(f"refusing checkpoint {mid.hex()}: {exc}", reason="wrong_signer")
            self.catalogue.manifest_refused(mid)
            if wait is not None:
                wait.error = error
                wait.found.set()
            else:
                log.warning("could not fetch checkpoint %s: %s", mid.hex()[:16], error)
            return
        self.holdings.learn(mid, envelope, manifest)
        if wait is not None:
            wait.result = (envelope, manifest)
            wait.found.set()
        self.apply(self.catalogue.manifest_verified(mid))

    def on_transfer_close(self, peer: Address, reason: str) -> None:
        if reason not in NOT_BANNED_FOR:
            self.ban(peer, reason)

    def ban(self, peer: Address, reason: str) -> None:
        log.warning("banning %s from the weight swarm: %s", peer, reason)
        self.dataplane.ban(peer)
        self.on_offence(peer, reason)

    # --- the catalogue's actions ----------------------------------------------------------------------

    def apply(self, actions: list[CatalogueAction[Address]]) -> None:
        """Carry out the catalogue's actions, in order."""
        for action in actions:
            if isinstance(action, SendOffer):
                self.dataplane.send(action.peer, encode(Offer(action.manifest_id, action.step)))
            elif isinstance(action, AskManifest):
                self.dataplane.send(action.peer, encode(ManifestRequest(action.manifest_id)))
            elif isinstance(action, SendManifest):
                envelope = self.holdings.known.get(action.manifest_id)
                if envelope is not None:
                    frame = encode(ManifestEnvelope(action.manifest_id, encode(envelope)))
                    self.dataplane.send(action.peer, frame)
            elif isinstance(action, OpenSession | CloseSession):
                version = self.holdings.versions.get(action.manifest_id)
                if version is not None and isinstance(action, OpenSession):
                    version.transfer.connected(action.peer, self.now())
                elif version is not None:
                    version.transfer.disconnected(action.peer, self.now())
            elif isinstance(action, StartFetch):
                self.on_follow(action.manifest_id)
            elif isinstance(action, Drop):
                self.on_drop(action.manifest_id)
            elif isinstance(action, GiveUp):
                log.info("no peer sent manifest %s: not following it", action.manifest_id.hex()[:16])
