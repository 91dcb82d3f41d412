"""Whole checkpoint transfers over DataPlanes on in-memory streams, under trio's autojump clock: the same
wiring as the TCP swarm (authenticated channels, bounded queues, CheckpointTransfer, real piece stores on
disk, byte-for-byte comparison) with every timer virtual, so the runs are quick and deterministic."""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from crypto.keys import Address, WalletKey
from prime_node.swarm.checkpoint_pieces import SharedCheckpoint, build_checkpoint
from prime_node.swarm.piece_store import PieceStore
from prime_node.swarm.transfer import CheckpointTransfer, OriginDirectory, PieceSource
from prime_node.swarm.transport import FAULT_PAUSE, DataPlane
from prime_node.testing.memory_streams import MemoryStreamNetwork
from prime_node.testing.swarm_fixtures import read_tree, write_model_dir
from protocol.codec import decode_any
from protocol.dataplane import DigestedFrame, Frame
from protocol.swarm.messages import Piece
from protocol.swarm.swarm_node import SwarmConfig

HOST = "10.0.0.1"
TICK = 1.0
TRAINER = WalletKey(hashlib.sha256(b"trainer").digest())


@dataclass
class SwarmPeer:
    """One node of the swarm: a DataPlane on the memory network driving one CheckpointTransfer."""

    key: WalletKey
    plane: DataPlane
    transfer: CheckpointTransfer
    port: int
    scope: trio.CancelScope
    done: trio.Event

    @property
    def address(self) -> Address:
        return self.key.address

    def dial(self, other: SwarmPeer) -> None:
        self.plane.dial(other.address, HOST, other.port)


def _address(peer: Hashable) -> Address:
    assert isinstance(peer, Address)
    return peer


async def start_swarm_peer(
    nursery: trio.Nursery,
    network: MemoryStreamNetwork,
    shared: SharedCheckpoint,
    pieces: PieceSource,
    *,
    seed: int,
    config: SwarmConfig | None = None,
    tamper: Callable[[Frame], Frame] | None = None,
) -> SwarmPeer:
    """Wire a transfer to a data plane as the swarm service does: callbacks in, ``send``/``close`` out, a
    tick every second of (virtual) time. ``tamper`` rewrites every frame this peer sends."""
    key = WalletKey(hashlib.sha256(b"peer %d" % seed).digest())
    done = trio.Event()
    planes: list[DataPlane] = []

    def send(peer: Hashable, frame: Frame) -> None:
        planes[0].send(_address(peer), tamper(frame) if tamper is not None else frame)

    transfer = CheckpointTransfer(
        shared.manifest,
        pieces,
        send=send,
        close=lambda peer, reason: planes[0].close(_address(peer)),
        rng=random.Random(seed),
        config=config,
        on_complete=done.set,
    )
    if transfer.completed:
        done.set()
    plane = DataPlane(
        key,
        on_up=lambda peer: transfer.connected(peer, trio.current_time()),
        on_frame=lambda peer, frame: transfer.frame(peer, frame, trio.current_time()),
        on_down=lambda peer: transfer.disconnected(peer, trio.current_time()),
        transport=network,
    )
    planes.append(plane)
    scope = trio.CancelScope()

    async def run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            async with trio.open_nursery() as inner:
                port = await inner.start(plane.run, HOST, 0)
                task_status.started(port)
                while True:
                    await trio.sleep(TICK)
                    transfer.tick(trio.current_time())

    port = await nursery.start(run)
    return SwarmPeer(key, plane, transfer, port, scope, done)


@pytest.fixture
def shared(tmp_path: Path) -> SharedCheckpoint:
    source = write_model_dir(tmp_path / "model", weight_bytes=1 << 20, shards=2, seed=3)
    return build_checkpoint(
        source, TRAINER, run="demo", step=1, now_ms=1_700_000_000_000, piece_size=16 << 10
    )


def full_store(path: Path, shared: SharedCheckpoint) -> PieceStore:
    """A piece store that already holds the whole checkpoint (a peer that fetched it earlier)."""
    store = PieceStore.open(path, shared.manifest)
    stream = b"".join((shared.directory / f.path).read_bytes() for f in shared.manifest.files)
    for index in range(shared.manifest.piece_count):
        start, end = shared.manifest.piece_span(index)
        assert store.write(index, stream[start:end])
    return store


def assert_identical(store: PieceStore, out: Path, shared: SharedCheckpoint) -> None:
    store.materialize(out)
    assert read_tree(out) == read_tree(shared.directory)


async def test_an_origin_and_three_fetchers_over_memory_streams_end_byte_identical(
    tmp_path: Path, shared: SharedCheckpoint, autojump_clock: trio.testing.MockClock
) -> None:
    network = MemoryStreamNetwork()
    stores = [PieceStore.open(tmp_path / f"fetcher{i}", shared.manifest) for i in range(3)]
    async with trio.open_nursery() as nursery:
        origin = await start_swarm_peer(
            nursery,
            network,
            shared,
            OriginDirectory(shared.directory, shared.manifest),
            seed=0,
            config=SwarmConfig(super_seed=True),
        )
        fetchers = [
            await start_swarm_peer(nursery, network, shared, store, seed=i + 1)
            for i, store in enumerate(stores)
        ]
        for i, fetcher in enumerate(fetchers):
            fetcher.dial(origin)
            for other in fetchers[i + 1 :]:
                fetcher.dial(other)
        with trio.fail_after(600):
            for fetcher in fetchers:
                await fetcher.done.wait()
        assert all(len(fetcher.plane.links) == 3 for fetcher in fetchers)
        nursery.cancel_scope.cancel()
    for i, store in enumerate(stores):
        assert store.complete
        assert_identical(store, tmp_path / f"out{i}", shared)
    # The fetchers fed each other: the super-seeding origin sent little more than one copy (three would
    # go out if each fetcher took everything from it) and the fetchers sent more than one between them.
    total = shared.manifest.total_size
    assert total <= origin.transfer.bytes_out < 2 * total
    assert sum(fetcher.transfer.bytes_out for fetcher in fetchers) > total
    assert origin.plane.bytes_out >= total  # the pieces it made went out on its streams


def _flip_piece_bytes(frame: Frame, *, claim_manifest_hash: bool) -> Frame:
    """A piece with its first byte flipped; the frame's MAC covers what is sent (a liar that MACs its own
    bytes) or, with ``claim_manifest_hash``, the manifest's hash (an honest node whose stored piece went
    bad: it sends the hash from the manifest without hashing the piece)."""
    if isinstance(frame, DigestedFrame):
        bulk = bytes([frame.bulk[0] ^ 1]) + bytes(frame.bulk[1:])
        return DigestedFrame(frame.head, bulk, frame.digest if claim_manifest_hash else None)
    message = decode_any(frame, max_bytes=Piece.MAX_BYTES)
    assert not isinstance(message, Piece)  # pieces always go digested
    return frame


async def test_a_corrupting_holder_is_banned_and_the_download_completes_identical(
    tmp_path: Path, shared: SharedCheckpoint, autojump_clock: trio.testing.MockClock
) -> None:
    flip_piece_bytes = functools.partial(_flip_piece_bytes, claim_manifest_hash=False)
    network = MemoryStreamNetwork()
    stores = [PieceStore.open(tmp_path / f"fetcher{i}", shared.manifest) for i in range(2)]
    async with trio.open_nursery() as nursery:
        honest = await start_swarm_peer(
            nursery, network, shared, full_store(tmp_path / "honest", shared), seed=0
        )
        liar = await start_swarm_peer(
            nursery, network, shared, full_store(tmp_path / "liar", shared), seed=1, tamper=flip_piece_bytes
        )
        fetchers = [
            await start_swarm_peer(nursery, network, shared, store, seed=i + 2)
            for i, store in enumerate(stores)
        ]
        for fetcher in fetchers:
            fetcher.dial(honest)
            fetcher.dial(liar)
        fetchers[0].dial(fetchers[1])
        with trio.fail_after(600):
            for fetcher in fetchers:
                await fetcher.done.wait()
        banned = [liar.address in fetcher.transfer.node.banned for fetcher in fetchers]
        assert any(banned)
        assert all(honest.address not in fetcher.transfer.node.banned for fetcher in fetchers)
        for fetcher, was_banned in zip(fetchers, banned, strict=True):
            if was_banned:
                assert liar.address not in fetcher.plane.links  # the data plane closed its channel
        nursery.cancel_scope.cancel()
    for i, store in enumerate(stores):
        assert_identical(store, tmp_path / f"out{i}", shared)


async def test_a_holder_whose_stored_pieces_went_bad_loses_its_channels_and_the_download_completes(
    tmp_path: Path,
    shared: SharedCheckpoint,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A sender MACs a piece with the manifest's hash instead of hashing it. If its copy went bad on disk,
    the receiver's own digest of the bytes differs, so the frame fails its MAC and the channel closes
    (bad_mac) before the piece is looked at: the download goes on from the others and stays identical.
    Nothing proves who changed the bytes (the sender or the path), so nobody is banned for it; but the
    sender gets no channel with the receiver, either way, until its pause (``FAULT_PAUSE``) is over."""
    flip_piece_bytes = functools.partial(_flip_piece_bytes, claim_manifest_hash=True)
    network = MemoryStreamNetwork()
    store = PieceStore.open(tmp_path / "fetcher", shared.manifest)
    async with trio.open_nursery() as nursery:
        honest = await start_swarm_peer(
            nursery, network, shared, full_store(tmp_path / "honest", shared), seed=0
        )
        rotten = await start_swarm_peer(
            nursery, network, shared, full_store(tmp_path / "rotten", shared), seed=1, tamper=flip_piece_bytes
        )
        fetcher = await start_swarm_peer(nursery, network, shared, store, seed=2)
        fetcher.dial(rotten)
        fetcher.dial(honest)
        with trio.fail_after(600):
            await fetcher.done.wait()
        assert rotten.transfer.bytes_out > 0  # it did send pieces
        assert "(bad_mac)" in caplog.text  # refused by the channel, not stored
        assert not fetcher.transfer.node.banned
        assert not fetcher.plane.faults.may_try(rotten.address, trio.current_time())
        fetcher.dial(rotten)
        assert rotten.address not in fetcher.plane.dialing  # paused: not dialled
        rotten.dial(fetcher)
        await trio.sleep(TICK)
        assert rotten.address not in fetcher.plane.links and fetcher.address not in rotten.plane.links
        await trio.sleep(FAULT_PAUSE)
        fetcher.dial(rotten)  # the pause is over
        await trio.sleep(TICK)
        assert rotten.address in fetcher.plane.links
        nursery.cancel_scope.cancel()
    assert_identical(store, tmp_path / "out", shared)


class WatchedStore:
    """A PieceSource that calls ``after_write`` each time a piece is stored. Pieces flow without virtual
    time moving, so polling would only ever see a finished transfer; this acts at an exact point in it."""

    def __init__(self, store: PieceStore, after_write: Callable[[], None]) -> None:
        self.store = store
        self.have = store.have
        self.after_write = after_write

    def read(self, index: int) -> bytes:
        return self.store.read(index)

    def write(self, index: int, data: bytes, *, digest: bytes | None = None) -> bool:
        stored = self.store.write(index, data, digest=digest)
        self.have = self.store.have
        self.after_write()
        return stored


async def test_half_the_seeders_leave_mid_transfer_and_every_remaining_fetcher_completes(
    tmp_path: Path, shared: SharedCheckpoint, autojump_clock: trio.testing.MockClock
) -> None:
    """The in-memory twin of test_network_swarm's slow TCP test: four seeders hold the checkpoint, two of
    them leave once a fetcher is a tenth of the way through, and the fetchers finish from the rest."""
    network = MemoryStreamNetwork()
    stores = [PieceStore.open(tmp_path / f"fetcher{i}", shared.manifest) for i in range(3)]
    count = shared.manifest.piece_count
    held_at_leave: list[int] = []

    def leave_at_a_tenth() -> None:
        if not held_at_leave and any(store.piece_count_held >= count // 10 for store in stores):
            held_at_leave.extend(store.piece_count_held for store in stores)
            for seeder in seeders[2:]:
                seeder.scope.cancel()

    async with trio.open_nursery() as nursery:
        seeders = [
            await start_swarm_peer(
                nursery, network, shared, full_store(tmp_path / f"seed{i}", shared), seed=i
            )
            for i in range(4)
        ]
        fetchers = [
            await start_swarm_peer(
                nursery, network, shared, WatchedStore(store, leave_at_a_tenth), seed=i + 4
            )
            for i, store in enumerate(stores)
        ]
        for i, fetcher in enumerate(fetchers):
            for seeder in seeders:
                fetcher.dial(seeder)
            for other in fetchers[i + 1 :]:
                fetcher.dial(other)
        with trio.fail_after(600):
            for fetcher in fetchers:
                await fetcher.done.wait()
        assert held_at_leave and max(held_at_leave) < count  # they left mid-transfer
        for fetcher in fetchers:
            assert not {seeder.address for seeder in seeders[2:]} & set(fetcher.plane.links)
        nursery.cancel_scope.cancel()
    for i, store in enumerate(stores):
        assert_identical(store, tmp_path / f"out{i}", shared)
