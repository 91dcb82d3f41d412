"""The inbox's terms: its settings, the hooks a node wires in, and what it asks of its owner (``Intake``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from crypto.digests import blake3
from crypto.keys import Address
from prime_node.verification.reasons import BELOW_FLOOR
from prime_node.verification.transfer_settings import TransferSettings
from protocol.rollout_transfer import RolloutAnnouncement, read_announcement
from protocol.rollouts import BatchHeader

INTAKE_COUNTS = (
    "refused_on_arrival",
    "charged",
    "dropped_backlog",
    "refused_worker_fetches",
    "refused_worker_bytes",
    "evicted_fetches",
    "undelivered",
    "banned_senders",
    "dropped_banned",
    BELOW_FLOOR,
)
"""The counters of the intake every owner's status shows."""


class Archive(Protocol):
    def keep(self, frame: bytes, *, batch_id: str, worker: str, policy_step: int) -> Path | None: ...


@dataclass(frozen=True)
class IntakeHooks:
    """Providers the node wires in (module doc); each may be None."""

    archive: Archive | None = None
    floor: Callable[[], int | None] | None = None


@dataclass(frozen=True)
class StepBound:
    """How far ahead a claimed policy step may be: at most ``future_steps`` past ``newest()``."""

    newest: Callable[[], int]
    certain: Callable[[], bool] = lambda: True
    """Whether ``newest`` is authoritative (then a claim past it costs ``bad_data``, else ``stale``)."""
    future_steps: int = 1


@dataclass(frozen=True)
class InboxSettings:
    """What differs between the roles, and the bounds of the fetches (module doc)."""

    fetch_on_arrival: bool = True
    reannounce: bool = True
    max_fetches: int = 64
    max_held_bytes: int = 1 << 30
    """Fetches reserved plus the frames the owner holds (``Intake.arrived`` returned True), in bytes."""
    per_worker_fetches: int = 4
    per_worker_fetch_bytes: int = 256 << 20
    max_offers: int = 256
    """Offers kept until wanted (``fetch_on_arrival=False``), all workers together."""
    per_worker_offers: int = 16
    archive_pending: int = 16
    delivery_stage: str = "delivery"
    """The stage (``StageTimes``) a frame's gossip latency is counted under."""
    transfer: TransferSettings | None = None

    def __post_init__(self) -> None:
        sizes = (self.max_fetches, self.max_held_bytes, self.per_worker_fetches, self.per_worker_fetch_bytes)
        if min(*sizes, self.max_offers, self.per_worker_offers, self.archive_pending) < 1:
            raise ValueError("inbox bounds must be positive")


@dataclass(frozen=True)
class Arrival:
    """A whole frame that passed screening (or was vouched for by an accepting quorum)."""

    frame: bytes
    batch_id: bytes
    header: BatchHeader
    origin: Address
    origin_peer_id: str
    announced: RolloutAnnouncement | None = None


class Intake(Protocol):
    """What the owning service does with the inbox's output."""

    def arrived(self, arrival: Arrival) -> bool:
        """Take a frame; True when the owner holds it (its bytes count until ``Inbox.release``)."""

    def refused(self, batch_id: bytes, reason: str) -> None:
        """Record a batch refused (or dropped below the floor) on arrival."""

    def known(self, batch_id: bytes) -> bool:
        """Whether the owner already has or settled the batch (then it is ignored)."""

    def room(self, fetching: int) -> bool:
        """Whether a wanted batch may start fetching with ``fetching`` fetches running."""

    def offered(self, batch_id: bytes) -> None:
        """An offer was kept (``fetch_on_arrival=False``): the owner may ``want`` it now."""


def new_batch_id(payload: bytes, origin: Address) -> bytes | None:
    """The id of the new batch a ``rollouts`` message brings, for a demand view that only counts them: a
    gossiped frame's BLAKE3, or the id of a worker's own offer; None for a re-server's announcement of a
    batch already offered (roles/demand_taps.py's backlog reads the topic this way)."""
    announcement = read_announcement(payload)
    if announcement is None:
        return blake3(payload)
    return announcement.batch_id if announcement.worker == origin else None
