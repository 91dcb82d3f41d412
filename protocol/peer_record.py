"""Signed peer records: what a node says about itself in every heartbeat.

A record names the node (address, peer ID), how to reach it (full ``/p2p/`` multiaddrs), what it does
(role), what it can do (a small hardware summary), what it holds (checkpoint steps) and how busy it is.
It travels as the payload of a gossip frame inside a signed ``Envelope``. Receivers accept it only if the
envelope's signer, the record's address and the peer ID the transport authenticated all name one key: a
peer can speak only for itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

from crypto.errors import CryptoError
from crypto.identity import address_from_peer_id
from crypto.keys import Address
from protocol.codec import IntRange, MaxLen, Message, decode, message
from protocol.envelope import Envelope
from protocol.errors import InvariantError, RemoteProtocolError
from protocol.membership import Member
from protocol.roles import ROLE_SETTINGS

ROLES = ROLE_SETTINGS
"""What a record's ``role`` may say (protocol/roles.py): a role, or ``auto`` before the policy chose."""
MAX_MULTIADDRS = 8
MAX_MULTIADDR_CHARS = 256
MAX_VERSIONS_HELD = 16
MAX_PEER_ID_CHARS = 128
MAX_DEVICE_CHARS = 16
_U31 = IntRange(0, (1 << 31) - 1)
_U63 = IntRange(0, (1 << 63) - 1)


@message("p2p.hardware", max_bytes=256)
@dataclass(frozen=True)
class HardwareSummary(Message):
    """Enough for peers to guess what a node can take on; the node's own probe is the detailed truth."""

    cpu_cores: Annotated[int, IntRange(0, 1 << 16)]
    ram_mib: Annotated[int, _U31]
    gpu_count: Annotated[int, IntRange(0, 1024)]
    gpu_vram_mib: Annotated[int, _U31]
    device: Annotated[str, MaxLen(MAX_DEVICE_CHARS)] = ""
    """Where the node's role computes (``cpu``, ``cuda:1``); empty while it runs no model."""


@message("p2p.peer_record", max_bytes=4096)
@dataclass(frozen=True)
class PeerRecord(Message):
    """One node's self-description as of one heartbeat."""

    address: Address
    peer_id: Annotated[str, MaxLen(MAX_PEER_ID_CHARS)]
    role: Annotated[str, MaxLen(16)]
    multiaddrs: Annotated[tuple[Annotated[str, MaxLen(MAX_MULTIADDR_CHARS)], ...], MaxLen(MAX_MULTIADDRS)]
    hardware: HardwareSummary
    versions_held: Annotated[tuple[Annotated[int, _U63], ...], MaxLen(MAX_VERSIONS_HELD)]
    load_percent: Annotated[int, IntRange(0, 100)]
    software_version: Annotated[str, MaxLen(32)]
    dataplane_port: Annotated[int, IntRange(0, 65535)] = 0
    """TCP port of the node's data plane (weight-swarm pieces) on its multiaddrs' host; 0: none."""
    refresh_s: Annotated[int, IntRange(0, 86_400)] = 0
    """How often the owner re-issues this record (protocol/record_book.py); receivers clamp it."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvariantError(f"unknown role {self.role[:16]!r}", reason="bad_peer_record")
        for multiaddr in self.multiaddrs:
            if not multiaddr.startswith("/") or not multiaddr.endswith("/p2p/" + self.peer_id):
                raise InvariantError(
                    "every multiaddr must be a full /p2p/ address of the record's own peer",
                    reason="bad_peer_record",
                )
        try:
            peer_address = address_from_peer_id(self.peer_id)
        except CryptoError as exc:
            raise InvariantError(f"peer ID is not a wallet key's: {exc}", reason="bad_peer_record") from exc
        if peer_address != self.address:
            raise InvariantError("peer ID and address name different keys", reason="bad_peer_record")


def peer_id_of(address: Address, members: Iterable[Member[PeerRecord]]) -> str | None:
    """The peer ID of the live member whose record is ``address``'s (the one lookup from a wallet address,
    as verdicts and the data plane name peers, to the peer ID the peer policy scores); None if unknown."""
    return next((member.peer_id for member in members if member.record.address == address), None)


def check_sender(envelope: Envelope, sender_peer_id: str) -> Address:
    """The envelope must be signed by the key behind the peer ID the transport authenticated."""
    try:
        sender_address = address_from_peer_id(sender_peer_id)
    except CryptoError as exc:
        raise RemoteProtocolError(f"sender peer ID is not a wallet key: {exc}", reason="bad_peer_id") from exc
    if envelope.signer != sender_address:
        raise RemoteProtocolError(
            f"message signed by {envelope.signer} but sent by {sender_address}", reason="signer_mismatch"
        )
    return sender_address


def parse_peer_record(payload: bytes, signer: Address) -> PeerRecord:
    """Decode a record and check it describes its signer (the envelope is already verified)."""
    return check_record_signer(decode(payload, PeerRecord), signer)


def check_record_signer(record: PeerRecord, signer: Address) -> PeerRecord:
    """A node speaks only for itself: the record must describe the key that signed its envelope."""
    if record.address != signer:
        raise RemoteProtocolError(f"record for {record.address} signed by {signer}", reason="signer_mismatch")
    return record
