"""``RolloutInbox``: the one intake of the ``rollouts`` topic (the package doc says what it does and why)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from crypto.digests import blake3
from crypto.keys import Address, WalletKey
from prime_node.errors import NodeError
from prime_node.node.stage_times import StageTimes
from prime_node.verification.batch_publish import ROLLOUTS_TOPIC
from prime_node.verification.batch_transfer import BatchTransfer, ban_peer
from prime_node.verification.fair_slots import NewestFirstQueue
from prime_node.verification.inbox.archiving import Archiver
from prime_node.verification.inbox.bounds import FetchBounds, Reservation
from prime_node.verification.inbox.terms import (
    Arrival,
    InboxSettings,
    Intake,
    IntakeHooks,
    StepBound,
)
from prime_node.verification.proving import rollout_domain
from prime_node.verification.reasons import BELOW_FLOOR, Reason
from protocol.codec import encode
from protocol.envelope import FreshnessWindow
from protocol.errors import RemoteProtocolError
from protocol.rollout_screen import MALFORMED_BATCH, MALFORMED_ENVELOPE, offence_for, screen_rollout
from protocol.rollout_transfer import (
    Holder,
    RolloutAnnouncement,
    check_frame_start,
    read_announcement,
    screen_announcement,
)
from protocol.rollouts import BatchHeader
from protocol.scoring import Offence

if TYPE_CHECKING:
    from prime_node.config import RunConfig
    from prime_node.node.context import NodeContext
    from prime_node.node.gossip import Delivered
    from prime_node.verification.reputation import ReputationService

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Offer:
    announcement: RolloutAnnouncement
    origin: Address
    peer_id: str
    sent_ms: int


class RolloutInbox:
    """The ``rollouts`` topic in, screened frames out to ``intake`` (module doc)."""

    def __init__(
        self,
        *,
        run_config: RunConfig,
        intake: Intake,
        settings: InboxSettings | None = None,
        reputation: ReputationService | None = None,
        transfer: BatchTransfer | None = None,
        steps: StepBound | None = None,
        hooks: IntakeHooks | None = None,
    ) -> None:
        self.run_config = run_config
        self.intake = intake
        self.settings = settings or InboxSettings()
        self.reputation = reputation
        self.transfer = transfer
        self.steps = steps
        self.hooks = hooks or IntakeHooks()
        self.domain = rollout_domain(run_config.run_id)
        self.window = FreshnessWindow()
        self.counts: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.stages = StageTimes()
        settings = self.settings
        self.bounds = FetchBounds(
            total=settings.max_fetches,
            max_bytes=settings.max_held_bytes,
            per_worker=settings.per_worker_fetches,
            per_worker_bytes=settings.per_worker_fetch_bytes,
            counts=self.counts,
        )
        self.offers: NewestFirstQueue[Address, bytes] = NewestFirstQueue(
            capacity=self.settings.max_offers, per_key=self.settings.per_worker_offers
        )
        self._offers: dict[bytes, _Offer] = {}
        self.wanted: NewestFirstQueue[Address, bytes] = NewestFirstQueue(
            capacity=self.settings.max_offers, per_key=self.settings.max_offers
        )
        self.archiver: Archiver | None = None
        """Runs ``hooks.archive`` (made when first needed: the node may wire the hook after construction)."""
        self._context: NodeContext | None = None
        self._nursery: trio.Nursery | None = None

    @property
    def context(self) -> NodeContext:
        if self._context is None:
            raise NodeError("the rollout inbox is not running", reason="not_running")
        return self._context

    async def run(
        self,
        context: NodeContext,
        *,
        key: WalletKey | None = None,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Start the transfer (unless given running; built with ``key``, else the node's) and subscribe;
        serves until cancelled."""
        self._context = context
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.transfer is None:
                self.transfer = BatchTransfer.for_node(
                    context,
                    key or context.key,
                    on_bad_bytes=self.on_bad_bytes,
                    on_undelivered=self.on_undelivered,
                    settings=self.settings.transfer,
                )
            if not self.transfer.running:
                await nursery.start(self.transfer.run)
            await context.gossip.subscribe(ROLLOUTS_TOPIC, self.on_rollout)
            task_status.started()
            await trio.sleep_forever()

    def status(self) -> dict[str, Any]:
        """The intake's part of its owner's status section."""
        keys = (
            "refused_on_arrival",
            "charged",
            "undelivered",
            "banned_senders",
            "dropped_banned",
            BELOW_FLOOR,
        )
        return {
            **{key: self.counts[key] for key in keys},
            "refused_reasons": dict(self.refused),
            "fetches_pending": self.bounds.fetches_pending,
            "held_bytes": self.bounds.held_bytes,
            "offers": len(self._offers),
            "waiting_to_fetch": len(self.wanted),
            "transfer": self.transfer.status() if self.transfer is not None else {},
        }

    @property
    def offers_kept(self) -> int:
        return len(self._offers)

    @property
    def fetches_pending(self) -> int:
        return self.bounds.fetches_pending

    @property
    def held_bytes(self) -> int:
        return self.bounds.held_bytes

    def release(self, size: int) -> None:
        """The owner let go of a frame it held (``Intake.arrived`` returned True)."""
        self.bounds.release(size)

    def below_floor(self, step: int) -> bool:
        floor = self.hooks.floor() if self.hooks.floor is not None else None
        return floor is not None and step < floor

    # -- arrival ----------------------------------------------------------------------------------------

    async def on_rollout(self, message: Delivered) -> None:
        if self.reputation is not None and self.reputation.worker_banned(message.origin):
            self.counts["dropped_banned"] += 1
            return
        announcement = read_announcement(message.payload)
        if announcement is not None:
            self._on_announcement(message, announcement)
            return
        self.take(message.payload, message.origin, message.origin_peer_id, sent_ms=message.timestamp_ms)

    def _on_announcement(self, message: Delivered, announcement: RolloutAnnouncement) -> None:
        """An offer: refuse it, keep it, or fetch it now (module doc)."""
        assert self.transfer is not None
        batch_id, origin, peer_id = announcement.batch_id, message.origin, message.origin_peer_id
        if not self.transfer.heard(announcement, origin, peer_id):
            return  # a re-server's announcement (now a known holder), or an offer heard before
        if self.intake.known(batch_id):
            return
        steps = self.steps
        try:
            screen_announcement(
                announcement,
                origin=origin,
                run_id=self.run_config.run_id,
                max_size=self.run_config.max_rollout_batch_bytes,
                newest_step=steps.newest() if steps is not None else None,
                future_steps=steps.future_steps if steps is not None else 0,
            )
        except RemoteProtocolError as exc:
            self.transfer.book.forget(batch_id)
            self.refuse(batch_id, peer_id, exc.reason, f"offer from {origin}: {exc}")
            return
        if self._below_floor(batch_id, announcement.policy_step):
            self.transfer.book.forget(batch_id)
            return
        if self.reputation is not None:
            self.reputation.learn(origin, peer_id)
        offer = _Offer(announcement, origin, peer_id, message.timestamp_ms)
        if self.settings.fetch_on_arrival:
            if not self._start_fetch(offer, count=True):
                self.transfer.book.forget(batch_id)
            return
        self._offers[batch_id] = offer
        for forgotten in self.offers.push(origin, announcement.policy_step, batch_id):
            self.counts["dropped_offers"] += 1
            self._forget_offer(forgotten)
        self.intake.offered(batch_id)

    def offer_of(self, batch_id: bytes) -> RolloutAnnouncement | None:
        """The kept offer of ``batch_id`` (``fetch_on_arrival=False``), if any."""
        offer = self._offers.get(batch_id)
        return None if offer is None else offer.announcement

    def want(self, batch_id: bytes) -> None:
        """The owner wants a kept offer's bytes now (fetched once it fits, newest step first)."""
        offer = self._offers.get(batch_id)
        if offer is not None:
            self.wanted.push(offer.origin, offer.announcement.policy_step, batch_id)
            self.pump()

    def forget(self, batch_id: bytes) -> None:
        """The owner settled a batch: drop its offer, if kept."""
        if batch_id in self._offers:
            self._forget_offer(batch_id)

    def _forget_offer(self, batch_id: bytes) -> None:
        self._offers.pop(batch_id, None)
        if self.transfer is not None:
            self.transfer.book.forget(batch_id)

    def pump(self) -> None:
        """Start wanted fetches while the owner has room and they fit the bounds (newest step first)."""
        deferred: list[tuple[Address, int, bytes]] = []
        while len(self.wanted) and self.intake.room(self.fetches_pending):
            worker, batch_id = self.wanted.pop()
            offer = self._offers.get(batch_id)
            if offer is None:
                continue  # settled or forgotten meanwhile
            if self._below_floor(batch_id, offer.announcement.policy_step):
                self._forget_offer(batch_id)
                continue
            if self._start_fetch(offer, count=False):
                del self._offers[batch_id]
            else:  # over the bounds: it waits for a fetch to end
                self.counts["fetch_deferred"] += 1
                deferred.append((worker, offer.announcement.policy_step, batch_id))
        for worker, step, batch_id in deferred:
            self.wanted.push(worker, step, batch_id)

    def _start_fetch(self, offer: _Offer, *, count: bool) -> bool:
        """Reserve a fetch of ``offer`` within the bounds (fetch_bounds.py) and start it; False if it does
        not fit (counted when ``count``)."""
        if self._nursery is None:
            return False
        reservation = self.bounds.reserve(offer.origin, offer.announcement.size, count=count)
        if reservation is None:
            return False
        self._nursery.start_soon(self._fetch, offer, reservation)
        return True

    async def _fetch(self, offer: _Offer, pending: Reservation) -> None:
        try:
            frame = await self._download(offer.announcement, pending)
            # Fetched for its offer; a trainer fetches only what an accepting quorum named by id.
            vouched = not self.settings.fetch_on_arrival
            if vouched and pending.scope.cancelled_caught:  # evicted: an accepted batch waits its turn again
                self._offers[offer.announcement.batch_id] = offer
                self.wanted.push(offer.origin, offer.announcement.policy_step, offer.announcement.batch_id)
            taken = frame is not None and self.take(
                frame,
                offer.origin,
                offer.peer_id,
                announced=offer.announcement,
                vouched=vouched,
                sent_ms=offer.sent_ms,
            )
        finally:
            self.pump()  # after ``take``: what it handed over counts against the owner's room
        if taken and self.settings.reannounce:
            await self._reannounce(offer.announcement)

    async def _download(self, announcement: RolloutAnnouncement, pending: Reservation) -> bytes | None:
        assert self.transfer is not None
        frame: bytes | None = None
        with pending.scope:
            try:
                fetching = trio.current_time()
                check = functools.partial(check_frame_start, announcement, kind=self.domain.kind)
                frame = await self.transfer.fetch(announcement.batch_id, announcement.size, check_start=check)
                self.stages.add("fetch", trio.current_time() - fetching)
            finally:
                self.bounds.end(pending)
        if pending.scope.cancelled_caught:
            log.info("fetch of batch %s evicted", announcement.batch_id.hex()[:16])
            return None
        if frame is None:
            self.counts["fetch_failed"] += 1
        return frame

    async def _reannounce(self, announcement: RolloutAnnouncement) -> None:
        """Tell peers this node holds the batch now (they may fetch it here instead of from the worker)."""
        assert self.transfer is not None
        try:
            replaced = dataclasses.replace(announcement, port=self.transfer.port)
            await self.context.gossip.publish(ROLLOUTS_TOPIC, encode(replaced))
        except NodeError as exc:
            log.info("batch %s not re-announced: %s", announcement.batch_id.hex()[:16], exc)

    def take(
        self,
        frame: bytes,
        origin: Address,
        peer_id: str,
        *,
        announced: RolloutAnnouncement | None = None,
        vouched: bool = False,
        sent_ms: int | None = None,
    ) -> bool:
        """A whole frame from ``origin`` (gossiped, or fetched for ``announced`` and checked against its id):
        screen it (unless ``vouched`` for by a quorum's verdicts on its id), then hand it to the owner.
        False if it was refused or dropped."""
        context = self.context
        if sent_ms is not None:
            self.stages.add(self.settings.delivery_stage, (context.clock.wall_ms() - sent_ms) / 1000)
        batch_id = announced.batch_id if announced is not None else blake3(frame)
        if self.intake.known(batch_id):
            return False
        steps = self.steps
        try:
            screened = screen_rollout(
                frame,
                domain=self.domain,
                window=self.window if not vouched else FreshnessWindow(1 << 62, 1 << 62),
                sender=origin,
                run_id=self.run_config.run_id,
                newest_step=steps.newest() if steps is not None else 1 << 62,
                future_steps=steps.future_steps if steps is not None else 0,
                now_ms=context.clock.wall_ms(),
            )
            header = screened.header
            if announced is not None and (header.policy_step, header.batch_counter) != (
                announced.policy_step,
                announced.batch_counter,
            ):
                raise RemoteProtocolError(
                    "the batch is not the one its worker announced", reason=MALFORMED_BATCH
                )
        except RemoteProtocolError as exc:
            code = exc.reason if exc.reason in Reason._value2member_map_ else MALFORMED_ENVELOPE
            self.refuse(batch_id, peer_id, code, f"frame from {origin}: {exc}")
            return False
        if self._below_floor(batch_id, header.policy_step):
            return False
        if self.reputation is not None:
            self.reputation.learn(origin, peer_id)
        self._archive(frame, batch_id, header)
        if self.intake.arrived(Arrival(frame, batch_id, header, origin, peer_id, announced)):
            self.bounds.hold(len(frame))
        return True

    def _below_floor(self, batch_id: bytes, step: int) -> bool:
        """Drop (uncharged) a batch below the trainer's floor; True if it was."""
        if not self.below_floor(step):
            return False
        self.counts[BELOW_FLOOR] += 1
        self.intake.refused(batch_id, BELOW_FLOOR)
        return True

    def _archive(self, frame: bytes, batch_id: bytes, header: BatchHeader) -> None:
        archive = self.hooks.archive
        if archive is None or self._nursery is None:
            return
        if self.archiver is None or self.archiver.archive is not archive:
            self.archiver = Archiver(archive, pending=self.settings.archive_pending, counts=self.counts)
        self.archiver.start(self._nursery, frame, batch_id, header)

    # -- charging (the one rule: module doc) ------------------------------------------------------------

    def refuse(self, batch_id: bytes, peer_id: str, reason: str, detail: str) -> None:
        """Record a batch refused before judging, and charge the peer that sent it."""
        self.counts["refused_on_arrival"] += 1
        self.refused[reason] += 1
        self.intake.refused(batch_id, reason)
        log.info("refused a rollout batch: %s", detail)
        self.charge(peer_id, reason)

    def charge(self, peer_id: str, reason: str) -> None:
        """Charge the proven author of a refused frame (``offence_for``; lag costs nothing)."""
        certain = self.steps is not None and self.steps.certain()
        offence = offence_for(reason, certain=certain)
        if offence is not None and self._context is not None:
            self.counts["charged"] += 1
            self._context.policy.offence(peer_id, offence, f"rollout frame refused: {reason}")

    def on_bad_bytes(self, holder: Holder, reason: str) -> None:
        """A peer sent bytes that are not the batch it was asked for: banned (from the transfer's data plane
        already; here on the node's peer scores, protocol/scoring.py)."""
        self.counts["charged"] += 1
        self.counts["banned_senders"] += 1
        ban_peer(self.context.policy, holder.peer_id, f"rollout batch bytes: {reason}")

    def on_undelivered(self, holder: Holder, reason: str) -> None:
        """A worker did not deliver a batch it announced itself (no reply, too slow, ``missing``, its port
        refused): an offer it does not honour costs it as unsolicited gossip does."""
        self.counts["charged"] += 1
        self.counts["undelivered"] += 1
        self.context.policy.offence(
            holder.peer_id, Offence.UNSOLICITED, f"announced batch undelivered: {reason}"
        )
