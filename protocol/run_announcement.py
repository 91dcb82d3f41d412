"""The signed run announcement: how a joining node learns the run's config from the swarm (DESIGN §9).

The trainer signs one ``RunAnnouncement`` (run id, its own address, the run config as canonical JSON,
issue time) and gossips it periodically on topic ``run``; any node that accepted it also serves it on
request, so a late joiner need not wait for the next period. Local paths (model_dir, output_dir) are
not part of it: each node fills its own.

Which trainer to believe (``TrainerTrust``):
- pinned (``--trainer ADDRESS``): only announcements signed by that address are accepted;
- unpinned: trust on first use. The first valid announcement for the run fixes the trainer; later
  ones from anyone else are refused. A malicious peer that answers first can therefore make an
  unpinned joiner work for a fake run (it cannot harm the real one: every batch and verdict is still
  checked by the real trainer), which is why the joiner prints the trainer it trusted, and why
  operators who know the trainer's address should pin it.

Pure: the caller passes ``now_ms``; nothing here reads a clock or touches the network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

from crypto.keys import Address, WalletKey
from protocol.codec import IntRange, MaxLen, Message, decode, encode, message
from protocol.envelope import Domain, Envelope, check_signature, seal
from protocol.errors import InvariantError, RemoteProtocolError
from protocol.topics import RUN_TOPIC

__all__ = [  # RUN_TOPIC is re-exported for roles/announcement.py
    "MAX_CONFIG_BYTES",
    "MAX_SKEW_MS",
    "RUN_KIND",
    "RUN_TOPIC",
    "RunAnnouncement",
    "TrainerTrust",
    "announcement_domain",
    "canonical_json",
    "config_of",
    "open_announcement",
    "seal_announcement",
]

RUN_KIND = "run"
MAX_CONFIG_BYTES = 16 * 1024
MAX_SKEW_MS = 30_000
_U63 = (1 << 63) - 1


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


class TrainerTrust:
    """Decides which run announcement a node believes: a pinned trainer, or trust on first use.

    ``offer`` returns the announcement when it is (still) the trusted one, and raises
    RemoteProtocolError otherwise (``untrusted_trainer`` for a valid announcement by another signer).
    The newest announcement of the trusted trainer wins; a config that differs from the first accepted
    one is refused (``config_changed``): a run's config is fixed for its lifetime.
    """

    def __init__(self, run_id: str, *, pinned: Address | None = None) -> None:
        self.run_id = run_id
        self.pinned = pinned
        self.trainer: Address | None = pinned
        self.current: RunAnnouncement | None = None
        self.envelope: Envelope | None = None
        self.trusted_on_first_use = False

    def offer(self, envelope: Envelope, *, now_ms: int) -> RunAnnouncement:
        announcement = open_announcement(envelope, run_id=self.run_id, now_ms=now_ms)
        if self.trainer is not None and announcement.trainer != self.trainer:
            raise RemoteProtocolError(
                f"announcement signed by {announcement.trainer}, trusted trainer is {self.trainer}",
                reason="untrusted_trainer",
            )
        if self.current is not None:
            if announcement.config_json != self.current.config_json:
                raise RemoteProtocolError("the announced run config changed", reason="config_changed")
            if announcement.issued_at_ms <= self.current.issued_at_ms:
                return self.current
        elif self.trainer is None:
            self.trusted_on_first_use = True
        self.trainer = announcement.trainer
        self.current = announcement
        self.envelope = envelope
        return announcement
