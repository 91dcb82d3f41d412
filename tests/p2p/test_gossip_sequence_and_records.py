"""Sequence tracking (gaps → repair requests) and signed peer records, as pure code."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from crypto.identity import peer_id_from_public_key
from crypto.keys import WalletKey
from protocol.codec import decode, encode
from protocol.envelope import Domain, seal
from protocol.errors import InvariantError, RemoteProtocolError
from protocol.gossip_sequence import Deliver, Ignore, RequestMissing, SequenceTracker
from protocol.peer_record import HardwareSummary, PeerRecord, check_sender, parse_peer_record

HW = HardwareSummary(cpu_cores=2, ram_mib=1024, gpu_count=0, gpu_vram_mib=0)


def test_a_gap_asks_for_exactly_the_missing_numbers_and_repair_delivers_them() -> None:
    tracker = SequenceTracker()
    assert tracker.observe("a", 1, 0, 0.0) == [Deliver("a", 0, repaired=False)]
    assert tracker.observe("a", 1, 4, 0.0) == [Deliver("a", 4, repaired=False), RequestMissing("a", 1, 1, 3)]
    assert tracker.observe("a", 1, 2, 0.1) == [Deliver("a", 2, repaired=True)]
    assert tracker.observe("a", 1, 2, 0.2) == [Ignore("a", "duplicate")]
    assert tracker.missing("a") == [1, 3]
    assert tracker.expire(100.0) == 2 and tracker.missing("a") == []


def test_a_restart_starts_a_new_epoch_and_old_epochs_are_ignored() -> None:
    tracker = SequenceTracker()
    tracker.observe("a", 1, 10, 0.0)
    assert tracker.observe("a", 2, 0, 0.0) == [Deliver("a", 0, repaired=False)]
    assert tracker.observe("a", 1, 11, 0.0) == [Ignore("a", "old_epoch")]


@given(st.lists(st.integers(0, 300), max_size=200))
def test_every_number_is_delivered_at_most_once_and_memory_stays_bounded(sequence: list[int]) -> None:
    tracker = SequenceTracker(max_gap=16)
    delivered: list[int] = []
    for number in sequence:
        for action in tracker.observe("a", 1, number, 0.0):
            if isinstance(action, Deliver):
                delivered.append(action.sequence)
            if isinstance(action, RequestMissing):
                assert 0 < action.last - action.first + 1 <= 16
        assert len(tracker.missing("a")) <= 16
    assert len(delivered) == len(set(delivered))


def _record(key: WalletKey) -> PeerRecord:
    peer_id = peer_id_from_public_key(key.public_key)
    return PeerRecord(
        key.address, peer_id, "seeder", (f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}",), HW, (3,), 5, "0.1.0"
    )


def test_a_record_round_trips_and_checks_its_signer() -> None:
    key = WalletKey.generate()
    record = _record(key)
    assert decode(encode(record), PeerRecord) == record
    envelope = seal(key, Domain("gossip", "run"), encode(record), now_ms=1)
    assert check_sender(envelope, record.peer_id) == key.address
    assert parse_peer_record(envelope.payload, envelope.signer) == record


def test_a_record_signed_or_sent_by_another_key_is_refused() -> None:
    key, other = WalletKey.generate(), WalletKey.generate()
    envelope = seal(other, Domain("gossip", "run"), encode(_record(key)), now_ms=1)
    with pytest.raises(RemoteProtocolError) as sent_by_other:
        check_sender(envelope, peer_id_from_public_key(key.public_key))
    assert sent_by_other.value.reason == "signer_mismatch"
    with pytest.raises(RemoteProtocolError) as describes_other:
        parse_peer_record(envelope.payload, other.address)
    assert describes_other.value.reason == "signer_mismatch"


def test_a_record_must_describe_one_key() -> None:
    key, other = WalletKey.generate(), WalletKey.generate()
    with pytest.raises(InvariantError):
        PeerRecord(other.address, peer_id_from_public_key(key.public_key), "seeder", (), HW, (), 0, "x")
    with pytest.raises(InvariantError):
        PeerRecord(key.address, peer_id_from_public_key(key.public_key), "emperor", (), HW, (), 0, "x")
