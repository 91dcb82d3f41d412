"""CheckpointTransfer end to end without a network: a real model directory shared by an origin, fetched
by several peers into real piece stores through the codec, and written out byte-identical."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from crypto.keys import WalletKey
from prime_node.swarm.checkpoint_pieces import SharedCheckpoint, build_checkpoint
from prime_node.swarm.piece_store import PieceStore
from prime_node.swarm.transfer import CheckpointTransfer, OriginDirectory, PieceSource, decode_frame
from prime_node.testing.swarm_fixtures import read_tree, write_model_dir
from prime_node.testing.swarm_loopback import LoopbackSwarm
from protocol.dataplane import DigestedFrame, Frame
from protocol.swarm.messages import Piece, Reject
from protocol.swarm.swarm_node import SwarmConfig

KEY = WalletKey(bytes(31) + b"\x0b")


@pytest.fixture
def shared(tmp_path: Path) -> SharedCheckpoint:
    source = write_model_dir(tmp_path / "model", weight_bytes=120_000, seed=9)
    return build_checkpoint(source, KEY, run="demo", step=2, now_ms=int(time.time() * 1000), piece_size=2048)


def swarm_of(
    tmp_path: Path, shared: SharedCheckpoint, fetchers: list[str], *, origin_links: int = 2
) -> tuple[LoopbackSwarm, dict[str, PieceStore]]:
    swarm = LoopbackSwarm()
    origin_config = SwarmConfig(super_seed=True)
    swarm.add(
        "origin",
        CheckpointTransfer(
            shared.manifest,
            OriginDirectory(shared.directory, shared.manifest),
            send=swarm.sender("origin"),
            close=swarm.closer("origin"),
            rng=random.Random(0),
            config=origin_config,
        ),
    )
    stores = {}
    for i, name in enumerate(fetchers):
        store = PieceStore.open(tmp_path / name / "store", shared.manifest)
        stores[name] = store
        add_fetcher(swarm, shared, name, store, seed=i + 1)
    for name in fetchers[:origin_links]:
        swarm.connect("origin", name)
    for i, a in enumerate(fetchers):
        for b in fetchers[i + 1 :]:
            swarm.connect(a, b)
    return swarm, stores


def add_fetcher(
    swarm: LoopbackSwarm, shared: SharedCheckpoint, name: str, pieces: PieceSource, seed: int
) -> None:
    swarm.add(
        name,
        CheckpointTransfer(
            shared.manifest,
            pieces,
            send=swarm.sender(name),
            close=swarm.closer(name),
            rng=random.Random(seed),
        ),
    )


def test_fetchers_get_a_byte_identical_directory(tmp_path: Path, shared: SharedCheckpoint) -> None:
    fetchers = [f"peer{i}" for i in range(5)]
    swarm, stores = swarm_of(tmp_path, shared, fetchers)
    swarm.run()
    for name in fetchers:
        assert swarm.transfers[name].completed, name
        stores[name].materialize(tmp_path / name / "out")
        assert read_tree(tmp_path / name / "out") == read_tree(shared.directory)
    # Peers fed each other: the origin sent little more than one copy.
    origin_out = swarm.transfers["origin"].bytes_out
    peers_out = sum(swarm.transfers[n].bytes_out for n in fetchers)
    assert origin_out < 2 * shared.manifest.total_size < peers_out


def flip_piece_bytes(frame: Frame) -> Frame:
    """Every piece with a byte changed, MAC'd over what is sent (the liar hashes its own bytes)."""
    if isinstance(frame, DigestedFrame):
        return DigestedFrame(frame.head, bytes([frame.bulk[0] ^ 0x55]) + bytes(frame.bulk[1:]))
    return frame


def test_a_corrupting_seed_is_banned_and_downloads_still_complete(
    tmp_path: Path, shared: SharedCheckpoint
) -> None:
    fetchers = [f"peer{i}" for i in range(4)]
    swarm, stores = swarm_of(tmp_path, shared, fetchers, origin_links=1)
    # Mallory holds the whole checkpoint but flips a byte in every piece it sends.
    mallory_store = PieceStore.open(tmp_path / "mallory", shared.manifest)
    for index in range(shared.manifest.piece_count):
        start, end = shared.manifest.piece_span(index)
        stream = b"".join((shared.directory / f.path).read_bytes() for f in shared.manifest.files)
        assert mallory_store.write(index, stream[start:end])
    add_fetcher(swarm, shared, "mallory", mallory_store, seed=99)
    swarm.tamper["mallory"] = flip_piece_bytes
    for name in fetchers:
        swarm.connect("mallory", name)
    swarm.run()
    for name in fetchers:
        transfer = swarm.transfers[name]
        assert transfer.completed
        assert "mallory" in transfer.node.banned
        stores[name].materialize(tmp_path / name / "out")
        assert read_tree(tmp_path / name / "out") == read_tree(shared.directory)
    assert not any(swarm.transfers["mallory"].node.banned)


def test_garbage_frames_ban_the_sender(tmp_path: Path, shared: SharedCheckpoint) -> None:
    swarm, _ = swarm_of(tmp_path, shared, ["peer0", "peer1"])
    swarm.transfers["peer0"].frame("peer1", b"\xc1 not msgpack", 0.0)
    assert "peer1" in swarm.transfers["peer0"].node.banned
    assert frozenset(("peer0", "peer1")) not in swarm.links


def test_half_the_seeders_vanish_mid_transfer_and_the_rest_complete(
    tmp_path: Path, shared: SharedCheckpoint
) -> None:
    fetchers = [f"peer{i}" for i in range(8)]
    swarm, stores = swarm_of(tmp_path, shared, fetchers, origin_links=2)
    count = shared.manifest.piece_count
    swarm.run(stop=lambda: sum(s.piece_count_held for s in stores.values()) >= 2 * count)
    holders = [n for n in fetchers if stores[n].piece_count_held]
    assert len(holders) >= 4 and not all(stores[n].complete for n in fetchers)
    # Every other holder dies; the origin stays reachable through a survivor (peer1).
    gone = holders[::2]
    assert "peer1" not in gone
    for name in gone:
        swarm.disconnect(name)
    swarm.run()
    for name in set(fetchers) - set(gone):
        assert swarm.transfers[name].completed, name
        stores[name].materialize(tmp_path / name / "out")
        assert read_tree(tmp_path / name / "out") == read_tree(shared.directory)


def test_leechers_fetch_from_a_super_seeding_origin_and_serve_nobody(
    tmp_path: Path, shared: SharedCheckpoint
) -> None:
    """The one-tier layout: leechers (``upload=False``) linked to the origin and to each other all
    complete from the origin alone; the requests they send each other are refused and asked elsewhere."""
    swarm = LoopbackSwarm()
    swarm.add(
        "origin",
        CheckpointTransfer(
            shared.manifest,
            OriginDirectory(shared.directory, shared.manifest),
            send=swarm.sender("origin"),
            close=swarm.closer("origin"),
            rng=random.Random(0),
            config=SwarmConfig(super_seed=True),
        ),
    )
    leechers = [f"leech{i}" for i in range(4)]
    stores = {}
    for i, name in enumerate(leechers):
        stores[name] = PieceStore.open(tmp_path / name / "store", shared.manifest)
        swarm.add(
            name,
            CheckpointTransfer(
                shared.manifest,
                stores[name],
                send=swarm.sender(name),
                close=swarm.closer(name),
                rng=random.Random(i + 1),
                upload=False,
            ),
        )
        swarm.connect("origin", name)
    for i, a in enumerate(leechers):
        for b in leechers[i + 1 :]:
            swarm.connect(a, b)
    sent_by_leechers: list[object] = []

    def record(frame: Frame) -> Frame:
        sent_by_leechers.append(decode_frame(frame)[0])
        return frame

    for name in leechers:
        swarm.tamper[name] = record
    swarm.run()
    assert not [m for m in sent_by_leechers if isinstance(m, Piece)]
    assert any(isinstance(m, Reject) for m in sent_by_leechers)  # they did refuse each other
    for name, store in stores.items():
        assert swarm.transfers[name].completed, name
        store.materialize(tmp_path / name / "out")
        assert read_tree(tmp_path / name / "out") == read_tree(shared.directory)
    assert swarm.transfers["origin"].bytes_out >= len(leechers) * shared.manifest.total_size
