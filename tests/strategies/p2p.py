"""Hypothesis strategies for the p2p message types whose invariants random data rarely meets (a peer
record must name one key three ways; a repair span is bounded; a neighbour frame has a known kind).
Importing this module registers them."""

from __future__ import annotations

from hypothesis import strategies as st

from crypto.identity import peer_id_from_public_key
from crypto.keys import WalletKey
from protocol.gossip_sequence import MAX_REPAIR_SPAN, RepairRequest
from protocol.overlay import FrameKind, NeighbourFrame
from protocol.peer_record import MAX_MULTIADDRS, MAX_VERSIONS_HELD, ROLES, HardwareSummary, PeerRecord
from tests.strategies.messages import register_strategy

_U63 = (1 << 63) - 1


@st.composite
def peer_records(draw: st.DrawFn) -> PeerRecord:
    secret = draw(st.integers(1, (1 << 255)).map(lambda n: n.to_bytes(32, "big")))
    key = WalletKey(secret)
    peer_id = peer_id_from_public_key(key.public_key)
    ports = draw(st.lists(st.integers(0, 65535), max_size=MAX_MULTIADDRS))
    return PeerRecord(
        address=key.address,
        peer_id=peer_id,
        role=draw(st.sampled_from(ROLES)),
        multiaddrs=tuple(f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}" for port in ports),
        hardware=HardwareSummary(
            cpu_cores=draw(st.integers(0, 1 << 16)),
            ram_mib=draw(st.integers(0, (1 << 31) - 1)),
            gpu_count=draw(st.integers(0, 1024)),
            gpu_vram_mib=draw(st.integers(0, (1 << 31) - 1)),
        ),
        versions_held=tuple(draw(st.lists(st.integers(0, _U63), max_size=MAX_VERSIONS_HELD))),
        load_percent=draw(st.integers(0, 100)),
        software_version=draw(st.text(max_size=32)),
        dataplane_port=draw(st.integers(0, 65535)),
        refresh_s=draw(st.integers(0, 86_400)),
    )


@st.composite
def repair_requests(draw: st.DrawFn) -> RepairRequest:
    first = draw(st.integers(0, _U63 - MAX_REPAIR_SPAN))
    return RepairRequest(
        topic=draw(st.text(max_size=128)),
        epoch_ms=draw(st.integers(0, _U63)),
        first=first,
        last=first + draw(st.integers(0, MAX_REPAIR_SPAN - 1)),
    )


@st.composite
def neighbour_frames(draw: st.DrawFn) -> NeighbourFrame:
    return NeighbourFrame(
        kind=draw(st.sampled_from(list(FrameKind))).value,
        sent_ms=draw(st.integers(0, _U63)),
        records=tuple(draw(st.lists(st.binary(max_size=700), max_size=8))),
    )


register_strategy(PeerRecord, peer_records())
register_strategy(NeighbourFrame, neighbour_frames())
register_strategy(RepairRequest, repair_requests())
