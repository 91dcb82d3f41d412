"""The signed run announcement: how a joining node learns the run's config from the swarm (DESIGN §9).

The trainer signs one ``RunAnnouncement`` (run id, its own address, the run config as canonical JSON,
issue time) and gossips it periodically on topic ``run``; any node that believed it also serves it on
request, so a late joiner need not wait for the next period. Local paths (model_dir, output_dir) are
not part of it: each node fills its own.

Which trainer to believe (``TrainerTrust``): only the pinned one. A run is named to a joiner by a
``RunAddress``, ``RUN@0xTRAINER[,BOOTSTRAP...]`` (what ``join --run`` takes; ``--trainer`` is the same
pin), so the name itself commits to the trainer's key. Anyone can sign a valid announcement for any run
id, so an unpinned joiner believes nobody: it records who announces what (``Sighting``) so the user can
choose, and takes no role. Trust on first use was removed (issue 13): whoever answered a fresh joiner
first became its trainer, served it checkpoints and named the task file its sandbox would run.

Pure: the caller passes ``now_ms``; nothing here reads a clock or touches the network.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Any

from crypto.errors import CryptoError
from crypto.keys import Address, WalletKey
from protocol.codec import IntRange, MaxLen, Message, decode, encode, message
from protocol.envelope import Domain, Envelope, check_signature, seal
from protocol.errors import InvariantError, RemoteProtocolError
from protocol.names import NAME_RULE, is_valid_name
from protocol.topics import RUN_TOPIC

__all__ = [  # RUN_TOPIC is re-exported for roles/announcement.py
    "MAX_BOOTSTRAP",
    "MAX_CONFIG_BYTES",
    "MAX_SIGHTINGS",
    "MAX_SKEW_MS",
    "RUN_KIND",
    "RUN_TOPIC",
    "RunAddress",
    "RunAnnouncement",
    "Sighting",
    "TrainerTrust",
    "announcement_domain",
    "canonical_json",
    "config_of",
    "open_announcement",
    "open_any_announcement",
    "seal_announcement",
]

RUN_KIND = "run"
MAX_CONFIG_BYTES = 16 * 1024
MAX_SKEW_MS = 30_000
MAX_SIGHTINGS = 16
"""Distinct (run, trainer) pairs remembered for display; the least recently seen is forgotten first."""
MAX_BOOTSTRAP = 8
MAX_MULTIADDR_CHARS = 512
RUN_ADDRESS_FORM = "RUN@0xTRAINER[,BOOTSTRAP...]"
_U63 = (1 << 63) - 1


@dataclass(frozen=True)
class RunAddress:
    """A run named so that the name commits to its trainer: ``RUN@0xTRAINER[,MULTIADDR...]``.

    The trainer prints it and its operator publishes it; a joiner pastes it as ``join --run``. The
    optional multiaddrs are bootstrap peers (full ``/p2p/`` addresses, checked by the node when it dials).
    """

    run_id: str
    trainer: Address
    bootstrap: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not is_valid_name(self.run_id):
            raise InvariantError(f"run id {self.run_id[:60]!r} {NAME_RULE}", reason="bad_run_address")
        if len(self.bootstrap) > MAX_BOOTSTRAP:
            raise InvariantError(
                f"a run address lists at most {MAX_BOOTSTRAP} bootstrap peers", reason="bad_run_address"
            )
        for multiaddr in self.bootstrap:
            if (
                not multiaddr.startswith("/")
                or len(multiaddr) > MAX_MULTIADDR_CHARS
                or any(ch in multiaddr for ch in ", @")
                or not multiaddr.isprintable()
            ):
                raise InvariantError(
                    f"not a multiaddr in a run address: {multiaddr[:80]!r}", reason="bad_run_address"
                )

    @classmethod
    def parse(cls, text: str) -> RunAddress:
        """InvariantError(reason="bad_run_address") unless ``text`` is ``RUN@0xADDRESS[,MULTIADDR...]``."""
        run_id, at, rest = text.strip().partition("@")
        trainer, *bootstrap = rest.split(",")
        missing = None
        if not at or not trainer.strip():
            missing = "trainer"
        elif not run_id:
            missing = "run id"
        elif any(not part.strip() for part in bootstrap):
            missing = "bootstrap peer after a comma"
        if missing is not None:  # name the part left out: "demo,/ip4/…" is a run address without "@0x…"
            raise InvariantError(
                f"run address {text[:80]!r} has no {missing}: expected {RUN_ADDRESS_FORM}",
                reason="bad_run_address",
            )
        if not is_valid_name(run_id):
            raise InvariantError(
                f"run address {text[:80]!r}: its run id {run_id[:60]!r} {NAME_RULE}", reason="bad_run_address"
            )
        try:
            address = Address.parse(trainer)
        except CryptoError as exc:
            raise InvariantError(
                f"run address {text[:80]!r}: trainer: {exc}", reason="bad_run_address"
            ) from None
        return cls(run_id, address, tuple(part.strip() for part in bootstrap))

    def __str__(self) -> str:
        return ",".join((f"{self.run_id}@{self.trainer}", *self.bootstrap))


@message("run.announcement", max_bytes=MAX_CONFIG_BYTES + 1024)
@dataclass(frozen=True)
class RunAnnouncement(Message):
    """The run's identity and its config (canonical JSON: sorted keys, no spaces), signed by its trainer."""

    run_id: Annotated[str, MaxLen(64)]
    trainer: Address
    config_json: Annotated[bytes, MaxLen(MAX_CONFIG_BYTES)]
    issued_at_ms: Annotated[int, IntRange(0, _U63)]


def canonical_json(config: dict[str, Any]) -> bytes:
    """The one byte form of a config mapping (what the trainer signs and every joiner re-checks)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def announcement_domain(run_id: str) -> Domain:
    return Domain(RUN_KIND, run_id)


def seal_announcement(key: WalletKey, announcement: RunAnnouncement, *, now_ms: int) -> Envelope:
    """Sign ``announcement`` as its trainer (the key must be the announcement's ``trainer``)."""
    if key.address != announcement.trainer:
        raise InvariantError(
            f"announcement names trainer {announcement.trainer}, but the key is {key.address}",
            reason="wrong_key",
        )
    return seal(key, announcement_domain(announcement.run_id), encode(announcement), now_ms=now_ms)


def config_of(announcement: RunAnnouncement) -> dict[str, Any]:
    """The announced config as a mapping; RemoteProtocolError if it is not canonical JSON of an object."""
    try:
        value = json.loads(announcement.config_json.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RemoteProtocolError(f"run config is not JSON: {exc}", reason="bad_run_config") from exc
    if not isinstance(value, dict):
        raise RemoteProtocolError("run config is not a JSON object", reason="bad_run_config")
    if canonical_json(value) != announcement.config_json:
        raise RemoteProtocolError("run config is not in canonical form", reason="bad_run_config")
    return value


def open_announcement(envelope: Envelope, *, run_id: str, now_ms: int) -> RunAnnouncement:
    """The announcement inside ``envelope`` if it is well formed and signed by the trainer it names.

    No replay or age check: an announcement stays true for the whole run and receiving it twice is
    harmless. Only a date in the future (beyond clock skew) is refused. Which trainer to *believe* is
    ``TrainerTrust``'s decision.
    """
    if envelope.domain != str(announcement_domain(run_id)):
        raise RemoteProtocolError(
            f"envelope for {envelope.domain[:80]!r}, not run {run_id}'s announcement", reason="wrong_domain"
        )
    check_signature(envelope)
    announcement = decode(envelope.payload, RunAnnouncement)
    if announcement.trainer != envelope.signer:
        raise RemoteProtocolError(
            f"announcement names trainer {announcement.trainer} but is signed by {envelope.signer}",
            reason="signer_mismatch",
        )
    if announcement.run_id != run_id:
        raise RemoteProtocolError("announcement names another run", reason="wrong_run")
    if announcement.issued_at_ms > now_ms + MAX_SKEW_MS or envelope.timestamp_ms > now_ms + MAX_SKEW_MS:
        raise RemoteProtocolError("announcement is dated in the future", reason="from_the_future")
    config = config_of(announcement)
    if config.get("run_id") != run_id:
        raise RemoteProtocolError("announced config names another run", reason="wrong_run")
    return announcement


def open_any_announcement(envelope: Envelope, *, now_ms: int) -> RunAnnouncement:
    """``open_announcement`` for whichever run the envelope's domain names (a peer asked directly may
    serve another run's announcement: worth showing to a user who passed the wrong run id)."""
    domain = Domain.parse(envelope.domain)
    if domain.kind != RUN_KIND:
        raise RemoteProtocolError(f"a {domain.kind} envelope, not a run announcement", reason="wrong_domain")
    return open_announcement(envelope, run_id=domain.run, now_ms=now_ms)


@dataclass
class Sighting:
    """One (run, trainer) pair seen announcing, for the user to choose from (never a reason to trust)."""

    run_id: str
    trainer: Address
    first_seen_ms: int
    last_seen_ms: int
    announcements: int = 0

    @property
    def address(self) -> RunAddress:
        return RunAddress(self.run_id, self.trainer)


class TrainerTrust:
    """Decides which run announcement a node believes: only one signed by the pinned trainer.

    ``offer`` returns the announcement when it is the pinned trainer's (newest first), and raises
    RemoteProtocolError otherwise: ``unpinned_trainer`` (no pin: nobody is believed),
    ``untrusted_trainer`` (another signer), ``wrong_run``, ``config_changed`` (a run's config is fixed
    for its lifetime), or the envelope's own faults. Every validly signed announcement, believed or not,
    is recorded in ``sightings`` (bounded, newest last; ``latest`` is the one the last offer touched), so
    conflicting announcements can be shown.
    """

    def __init__(
        self, run_id: str, *, pinned: Address | None = None, max_sightings: int = MAX_SIGHTINGS
    ) -> None:
        self.run_id = run_id
        self.pinned = pinned
        self.current: RunAnnouncement | None = None
        self.envelope: Envelope | None = None
        self.max_sightings = max_sightings
        self.sightings: OrderedDict[tuple[str, Address], Sighting] = OrderedDict()
        self.forgotten = 0
        self.latest: Sighting | None = None

    @property
    def trainer(self) -> Address | None:
        """The trainer whose announcements count (the pin), None when nobody's do."""
        return self.pinned

    def offer(self, envelope: Envelope, *, now_ms: int) -> RunAnnouncement:
        self.latest = None
        announcement = open_any_announcement(envelope, now_ms=now_ms)
        self.latest = self._sighted(announcement, now_ms)
        if announcement.run_id != self.run_id:
            raise RemoteProtocolError(
                f"an announcement of run {announcement.run_id}, not {self.run_id}", reason="wrong_run"
            )
        if self.pinned is None:
            raise RemoteProtocolError(
                f"trainer {announcement.trainer} announces run {self.run_id}, but no trainer is pinned",
                reason="unpinned_trainer",
            )
        if announcement.trainer != self.pinned:
            raise RemoteProtocolError(
                f"announcement signed by {announcement.trainer}, the pinned trainer is {self.pinned}",
                reason="untrusted_trainer",
            )
        if self.current is not None:
            if announcement.config_json != self.current.config_json:
                raise RemoteProtocolError("the announced run config changed", reason="config_changed")
            if announcement.issued_at_ms <= self.current.issued_at_ms:
                return self.current
        self.current = announcement
        self.envelope = envelope
        return announcement

    def _sighted(self, announcement: RunAnnouncement, now_ms: int) -> Sighting:
        key = (announcement.run_id, announcement.trainer)
        seen = self.sightings.get(key)
        if seen is None:
            kept = (self.run_id, self.pinned)
            while len(self.sightings) >= self.max_sightings:  # forget the stalest, never the pinned run
                stalest = next((k for k in self.sightings if k != kept), None)
                if stalest is None:
                    break
                del self.sightings[stalest]
                self.forgotten += 1
            seen = self.sightings[key] = Sighting(announcement.run_id, announcement.trainer, now_ms, now_ms)
        seen.last_seen_ms = max(seen.last_seen_ms, now_ms)
        seen.announcements += 1
        self.sightings.move_to_end(key)
        return seen
