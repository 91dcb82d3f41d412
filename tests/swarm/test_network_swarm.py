"""The weight swarm between real nodes: libp2p for discovery and gossip, authenticated TCP channels for
pieces, real model directories on disk compared byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.testing.swarm_fixtures import read_tree, write_model_dir
from protocol.dataplane import DigestedFrame
from tests.swarm.network_helpers import start_peer


async def test_share_on_one_node_and_fetch_on_three_others_byte_identical(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "model", weight_bytes=3 << 20, shards=2)
    trainer_key = WalletKey.generate()
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer_key.address, key=trainer_key)
        boot = (origin.node.advertised_multiaddrs()[0],)
        fetchers = [
            await start_peer(nursery, tmp_path, i, trainer=trainer_key.address, bootstrap=boot, follow=False)
            for i in (1, 2, 3)
        ]
        manifest = await origin.swarm.share(model, step=7, piece_size=256 << 10)
        paths: list[Path] = []

        async def fetch(peer):  # type: ignore[no-untyped-def]
            paths.append(await peer.swarm.fetch(manifest.id()))

        with trio.fail_after(60):
            async with trio.open_nursery() as fetching:
                for peer in fetchers:
                    fetching.start_soon(fetch, peer)
        expected = read_tree(model)
        assert len(paths) == 3
        for path in paths:
            assert read_tree(path) == expected
        for peer in fetchers:
            assert peer.swarm.locate(7) is not None
            section = peer.node.status_sections["checkpoints"]()
            assert section["versions"][0]["state"] == "complete"
            assert section["versions"][0]["have"] == manifest.piece_count
        status = origin.node.status_sections["checkpoints"]()
        assert status["bytes_out"] >= manifest.total_size
        nursery.cancel_scope.cancel()


async def test_followers_fetch_each_announced_version_and_keep_the_newest_two(tmp_path: Path) -> None:
    trainer_key = WalletKey.generate()
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer_key.address, key=trainer_key)
        boot = (origin.node.advertised_multiaddrs()[0],)
        followers = [
            await start_peer(nursery, tmp_path, i, trainer=trainer_key.address, bootstrap=boot, keep=2)
            for i in (1, 2)
        ]
        with trio.fail_after(60):
            for step in (1, 2, 3):
                model = write_model_dir(tmp_path / f"model{step}", weight_bytes=512 << 10, seed=step)
                await origin.swarm.share(model, step=step, piece_size=64 << 10)
                for peer in followers:
                    got, path = await peer.swarm.wait_newer(step - 1)
                    assert got == step
                    assert read_tree(path) == read_tree(model)
        for peer in followers:
            assert peer.swarm.locate(1) is None  # dropped: only the newest two are kept
            assert peer.swarm.locate(2) is not None
            assert sorted(peer.node.versions_held) == [2, 3]
            assert len(list((peer.swarm.store_dir / "checkpoints").iterdir())) == 2
        nursery.cancel_scope.cancel()


async def test_a_manifest_signed_by_another_key_is_refused(tmp_path: Path) -> None:
    trainer_key, impostor = WalletKey.generate(), WalletKey.generate()
    model = write_model_dir(tmp_path / "model", weight_bytes=256 << 10)
    async with trio.open_nursery() as nursery:
        fake = await start_peer(nursery, tmp_path, 0, trainer=None, key=impostor)
        boot = (fake.node.advertised_multiaddrs()[0],)
        victim = await start_peer(nursery, tmp_path, 1, trainer=trainer_key.address, bootstrap=boot)
        manifest = await fake.swarm.share(model, step=5)
        with trio.fail_after(30):
            try:
                await victim.swarm.fetch(manifest.id())
            except NodeError as exc:
                assert exc.reason == "wrong_signer"
                assert str(trainer_key.address) in str(exc)
            else:
                raise AssertionError("a manifest signed by another key was accepted")
        # Its gossip announcement was not followed either.
        await trio.sleep(1.0)
        assert victim.swarm.newest() is None
        assert not list((victim.swarm.store_dir / "pieces").iterdir())
        nursery.cancel_scope.cancel()


async def test_a_corrupting_peer_is_banned_and_the_download_completes_identical(tmp_path: Path) -> None:
    trainer_key = WalletKey.generate()
    model = write_model_dir(tmp_path / "model", weight_bytes=2 << 20, shards=2)
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer_key.address, key=trainer_key)
        boot = (origin.node.advertised_multiaddrs()[0],)
        honest = await start_peer(nursery, tmp_path, 1, trainer=trainer_key.address, bootstrap=boot)
        liar = await start_peer(nursery, tmp_path, 2, trainer=trainer_key.address, bootstrap=boot)
        send = liar.swarm.dataplane.send
        lying = False

        def corrupt(peer, frame):  # type: ignore[no-untyped-def]
            if lying and isinstance(frame, DigestedFrame):  # a piece, MAC'd over what the liar sends
                frame = DigestedFrame(frame.head, bytes([frame.bulk[0] ^ 1]) + bytes(frame.bulk[1:]))
            send(peer, frame)

        liar.swarm.dataplane.send = corrupt  # type: ignore[method-assign]
        manifest = await origin.swarm.share(model, step=1, piece_size=32 << 10)
        with trio.fail_after(60):
            await honest.swarm.wait_newer(None)
            await liar.swarm.wait_newer(None)
        origin.scope.cancel()  # from here on only the honest peer and the liar hold pieces
        lying = True
        fetchers = [
            await start_peer(
                nursery,
                tmp_path,
                i,
                trainer=trainer_key.address,
                bootstrap=(honest.node.advertised_multiaddrs()[0],),
                follow=False,
            )
            for i in (3, 4)
        ]
        with trio.fail_after(30):  # both holders are neighbours before the transfer starts
            while not all(
                {honest.node.key.address, liar.node.key.address} <= set(p.swarm.dataplane.links)
                for p in fetchers
            ):
                await trio.sleep(0.05)
        paths: list[Path] = []

        async def fetch(peer):  # type: ignore[no-untyped-def]
            paths.append(await peer.swarm.fetch(manifest.id()))

        with trio.fail_after(60):
            async with trio.open_nursery() as fetching:
                for peer in fetchers:
                    fetching.start_soon(fetch, peer)
        assert [read_tree(path) for path in paths] == [read_tree(model)] * 2
        banned = [liar.node.key.address in peer.swarm.dataplane.banned for peer in fetchers]
        assert any(banned)
        assert all(honest.node.key.address not in peer.swarm.dataplane.banned for peer in fetchers)
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_half_the_seeders_killed_mid_transfer_every_remaining_peer_completes(tmp_path: Path) -> None:
    trainer_key = WalletKey.generate()
    model = write_model_dir(tmp_path / "model", weight_bytes=8 << 20, shards=2)
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer_key.address, key=trainer_key)
        boot = (origin.node.advertised_multiaddrs()[0],)
        seeders = [
            await start_peer(nursery, tmp_path, i, trainer=trainer_key.address, bootstrap=boot)
            for i in (1, 2, 3, 4)
        ]
        manifest = await origin.swarm.share(model, step=1, piece_size=64 << 10)
        with trio.fail_after(120):
            for peer in seeders:
                await peer.swarm.wait_newer(None)
        origin.scope.cancel()  # the origin leaves: only the non-origin seeders hold pieces
        fetchers = [
            await start_peer(
                nursery,
                tmp_path,
                i,
                trainer=trainer_key.address,
                bootstrap=(seeders[0].node.advertised_multiaddrs()[0],),
            )
            for i in (5, 6, 7)
        ]
        with trio.fail_after(60):
            while not any(
                (p.swarm.progress(manifest.id()) or (0, 1))[0] >= manifest.piece_count // 10 for p in fetchers
            ):
                await trio.sleep(0.01)
        for peer in seeders[2:]:
            peer.scope.cancel()
        held_at_kill = [(p.swarm.progress(manifest.id()) or (0, 0))[0] for p in fetchers]
        assert min(held_at_kill) < manifest.piece_count  # the kill came mid-transfer
        with trio.fail_after(120):
            for peer in fetchers:
                _, path = await peer.swarm.wait_newer(None)
                assert read_tree(path) == read_tree(model)
        nursery.cancel_scope.cancel()
