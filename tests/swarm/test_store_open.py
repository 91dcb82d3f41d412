"""Opening a fetch's piece store (space reserved for every file, each piece a resumed store claims hashed
again: up to a minute for a 62 GB checkpoint) happens in a worker thread, so the node's other tasks keep
running meanwhile, and callers that ask for the same version while it opens share one store."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio

from crypto.keys import WalletKey
from prime_node.swarm.checkpoint_pieces import build_checkpoint
from prime_node.swarm.piece_store import PieceStore
from prime_node.swarm.service import SwarmService
from prime_node.testing.swarm_fixtures import write_model_dir

HANG_GUARD_S = 30.0
"""How long the open waits for the loop to tick: a loop blocked by the open never would."""


async def test_a_slow_store_open_leaves_the_event_loop_running_and_is_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = WalletKey.generate()
    model = write_model_dir(tmp_path / "model", weight_bytes=1 << 18, shards=2, seed=3)
    shared = build_checkpoint(model, trainer, run="test", step=1, now_ms=0, piece_size=16 << 10)
    swarm = SwarmService(
        key=WalletKey.generate(), run_id="test", trainer=trainer.address, store_dir=tmp_path / "store"
    )
    opened: list[PieceStore] = []
    loop_ran = threading.Event()  # set by a trio task: only a loop that kept running can set it
    real_open = PieceStore.open

    def slow_open(root: Path, manifest: object) -> PieceStore:  # a disk that takes its time
        loop_ran.clear()  # a tick from before the open proves nothing
        ran = loop_ran.wait(timeout=HANG_GUARD_S)  # held open until the event loop shows it still runs
        store = real_open(root, manifest)  # type: ignore[arg-type]
        opened.append(store)
        if not ran:
            raise AssertionError("the event loop did not run while the store was opening")
        return store

    monkeypatch.setattr(PieceStore, "open", slow_open)

    async def tick() -> None:
        while True:
            await trio.sleep(0.01)
            loop_ran.set()

    versions = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tick)

        async def start() -> None:
            versions.append(await swarm._start_fetch(shared.manifest, shared.envelope, None))

        async with trio.open_nursery() as starting:
            starting.start_soon(start)
            starting.start_soon(start)
        nursery.cancel_scope.cancel()
    assert len(opened) == 1 and versions[0] is versions[1] is swarm.versions[shared.manifest_id]
    assert versions[0].store is opened[0] and versions[0].store.piece_count_held == 0
    opened[0].close()
