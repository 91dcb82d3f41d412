"""``peer_id_of``: the one address → peer ID lookup over the membership table."""

from __future__ import annotations

from crypto.identity import peer_id_from_public_key
from crypto.keys import WalletKey
from protocol.membership import Membership
from protocol.peer_record import HardwareSummary, PeerRecord, peer_id_of

HW = HardwareSummary(cpu_cores=4, ram_mib=8192, gpu_count=0, gpu_vram_mib=0)


def _record(key: WalletKey) -> PeerRecord:
    peer_id = peer_id_from_public_key(key.public_key)
    return PeerRecord(
        key.address, peer_id, "inferer", (f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}",), HW, (), 0, "x"
    )


def test_an_address_maps_to_the_peer_id_that_heartbeats_as_it() -> None:
    keys = [WalletKey.generate() for _ in range(3)]
    membership: Membership[PeerRecord] = Membership()
    for now, key in enumerate(keys[:2]):
        record = _record(key)
        membership.heard(record.peer_id, record, float(now))
    for key in keys[:2]:
        assert peer_id_of(key.address, membership.members()) == peer_id_from_public_key(key.public_key)
    assert peer_id_of(keys[2].address, membership.members()) is None
    assert peer_id_of(keys[0].address, []) is None
