"""Delta versions through the weight swarm between real nodes (libp2p on 127.0.0.1, real data-plane
channels, real model directories): the trainer publishes a full version then deltas; followers rebuild
every step byte for byte from the version they hold, through a chain or the full version when they
missed one, refuse a trainer-signed delta that rebuilds anything else, keep the bases they need and
restore all of it after a restart."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from safetensors.numpy import load_file, save_file

from crypto.keys import Address, WalletKey
from prime_node.swarm.checkpoint_pieces import build_checkpoint
from prime_node.swarm.delta_versions import encode_delta_version
from prime_node.swarm.service import SwarmService, SwarmSettings
from prime_node.swarm.transfer import OriginDirectory
from prime_node.testing.swarm_fixtures import read_tree, write_model_dir
from protocol.swarm.catalogue import MAX_OFFERS_PER_PEER
from tests.p2p.helpers import make_config, start_node
from tests.swarm.network_helpers import OPEN, Peer, start_peer

WEIGHTS = 1 << 20
PIECE = 64 << 10


def evolve(source: Path, out: Path, *, seed: int, share: float = 0.01) -> Path:
    """A copy of the model ``source`` with about ``share`` of its weights changed (an RL step)."""
    shutil.copytree(source, out)
    rng = np.random.default_rng(seed)
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        for name, values in tensors.items():
            changed = rng.random(values.shape) < share
            values[changed] += rng.standard_normal(int(changed.sum())).astype(values.dtype)
            tensors[name] = values
        save_file(tensors, str(path))
    return out


def model_steps(tmp_path: Path, count: int) -> list[Path]:
    steps = [write_model_dir(tmp_path / "policy-0", weight_bytes=WEIGHTS, shards=2)]
    for step in range(1, count):
        steps.append(evolve(steps[-1], tmp_path / f"policy-{step}", seed=step))
    return steps


async def start_on_store(
    nursery: trio.Nursery,
    tmp_path: Path,
    index: int,
    store: Path,
    *,
    trainer: Address,
    bootstrap: tuple[str, ...],
    **options: Any,
) -> Peer:
    """A node whose swarm uses ``store`` (a restart of the node that used it)."""
    key = WalletKey.generate()
    swarm = SwarmService(
        key=key,
        run_id="test",
        trainer=trainer,
        store_dir=store,
        settings=SwarmSettings(**{"dataplane_host": "127.0.0.1", "seed": index, **options}),
    )
    config = make_config(tmp_path, index, bootstrap=bootstrap)
    node, scope = await start_node(nursery, OPEN, config, key=key, services=[swarm], serve_api=False)
    return Peer(node, swarm, scope)


def leftovers(swarm: SwarmService) -> list[str]:
    """Work directories (a delta being encoded or a version being rebuilt) left in the store."""
    return [p.name for p in (swarm.store_dir / "checkpoints").iterdir() if p.name.startswith(".")]


async def test_followers_rebuild_every_delta_byte_identical_and_keep_what_they_need(tmp_path: Path) -> None:
    steps = model_steps(tmp_path, 4)
    trainer_key = WalletKey.generate()
    trainer = trainer_key.address
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer, key=trainer_key, keep=2)
        boot = (origin.node.advertised_multiaddrs()[0],)
        followers = [
            await start_peer(nursery, tmp_path, i, trainer=trainer, bootstrap=boot, keep=2) for i in (1, 2)
        ]
        with trio.fail_after(90):
            first = await origin.swarm.publish(steps[0], step=0, piece_size=PIECE)
            assert (first.delta, first.reason) == (None, "no_base")
            for peer in followers:
                got, path = await peer.swarm.wait_newer(None)
                assert got == 0 and read_tree(path) == read_tree(steps[0])
            published = []
            for step in (1, 2, 3):
                shared = await origin.swarm.publish(
                    steps[step], step=step, delta_base=steps[step - 1], piece_size=PIECE
                )
                published.append(shared)
                assert shared.reason == "delta" and shared.delta is not None
                assert shared.announced == shared.delta
                assert (shared.delta.base, shared.delta.target) == (
                    (first.full if step == 1 else published[-2].full).id(),
                    shared.full.id(),
                )
                assert 0 < shared.delta_bytes < 0.5 * shared.full_bytes
                for peer in followers:
                    got, path = await peer.swarm.wait_newer(step - 1)
                    assert got == step
                    assert read_tree(path) == read_tree(steps[step])
                    assert (path / "config.json").is_file()  # inferers get full directories only
        full_bytes = published[-1].full_bytes
        for peer in followers:
            status = peer.node.status_sections["checkpoints"]()
            assert status["reconstructions"] == 3
            assert status["bad_deltas"] == 0
            assert 0 < status["delta_bytes_in"] < 3 * 0.5 * full_bytes
            # The newest two full steps and the deltas to them; step 1 and its delta are gone.
            kinds = sorted((v["step"], v["kind"]) for v in status["versions"])
            assert kinds == [(2, "delta"), (2, "full"), (3, "delta"), (3, "full")]
            assert peer.swarm.locate(1) is None and peer.swarm.locate(2) is not None
            assert sorted(peer.node.versions_held) == [2, 3]
            assert len(list((peer.swarm.store_dir / "checkpoints").iterdir())) == 4
            assert leftovers(peer.swarm) == []
        trainer_kinds = sorted((v["step"], v["kind"]) for v in origin.swarm.status()["versions"])
        assert trainer_kinds == [(2, "delta"), (2, "full"), (3, "delta"), (3, "full")]
        assert len(list((origin.swarm.store_dir / "checkpoints").iterdir())) == 2  # its deltas 2 and 3
        nursery.cancel_scope.cancel()


async def test_a_snapshot_or_a_large_delta_is_announced_as_the_full_version(tmp_path: Path) -> None:
    steps = model_steps(tmp_path, 2)
    rewritten = write_model_dir(tmp_path / "rewritten", weight_bytes=WEIGHTS, shards=2, seed=99)
    trainer_key = WalletKey.generate()
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer_key.address, key=trainer_key, keep=3)
        with trio.fail_after(60):
            await origin.swarm.publish(steps[0], step=0, piece_size=PIECE)
            snapshot = await origin.swarm.publish(steps[1], step=1, delta_base=steps[0], snapshot=True)
            assert (snapshot.delta, snapshot.reason, snapshot.announced) == (None, "snapshot", snapshot.full)
            large = await origin.swarm.publish(rewritten, step=2, delta_base=steps[1], max_delta_share=0.5)
            assert (large.delta, large.reason) == (None, "too_large")
            assert large.delta_bytes > 0.5 * large.full_bytes
            stranger = await origin.swarm.publish(steps[1], step=3, delta_base=tmp_path / "nowhere")
            assert stranger.reason == "base_not_held"
        assert leftovers(origin.swarm) == []
        assert not list((origin.swarm.store_dir / "checkpoints").iterdir())
        nursery.cancel_scope.cancel()


async def test_a_follower_that_missed_steps_ends_byte_identical(tmp_path: Path) -> None:
    """Offline for two steps: after its restart it catches up (chain, offers or full fallback) and
    follows the next delta from a version it holds."""
    steps = model_steps(tmp_path, 5)
    trainer_key = WalletKey.generate()
    trainer = trainer_key.address
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer, key=trainer_key, keep=2)
        boot = (origin.node.advertised_multiaddrs()[0],)
        steady = await start_peer(nursery, tmp_path, 1, trainer=trainer, bootstrap=boot, keep=2)
        late = await start_peer(nursery, tmp_path, 2, trainer=trainer, bootstrap=boot, keep=2)
        with trio.fail_after(120):
            await origin.swarm.publish(steps[0], step=0, piece_size=PIECE)
            for peer in (steady, late):
                await peer.swarm.wait_newer(None)
            late.scope.cancel()  # offline from here
            for step in (1, 2):
                await origin.swarm.publish(
                    steps[step], step=step, delta_base=steps[step - 1], piece_size=PIECE
                )
                await steady.swarm.wait_newer(step - 1)
            back = await start_on_store(
                nursery, tmp_path, 3, late.swarm.store_dir, trainer=trainer, bootstrap=boot, keep=2
            )
            assert back.swarm.locate(0) is not None  # restored
            got, path = await back.swarm.wait_newer(1)
            assert got == 2 and read_tree(path) == read_tree(steps[2])
            await origin.swarm.publish(steps[3], step=3, delta_base=steps[2], piece_size=PIECE)
            for peer in (steady, back):
                got, path = await peer.swarm.wait_newer(2)
                assert got == 3 and read_tree(path) == read_tree(steps[3])
        assert back.node.status_sections["checkpoints"]()["reconstructions"] >= 1
        nursery.cancel_scope.cancel()


async def test_fetch_of_a_delta_id_rebuilds_through_a_chain_of_known_deltas(tmp_path: Path) -> None:
    steps = model_steps(tmp_path, 3)
    trainer_key = WalletKey.generate()
    trainer = trainer_key.address
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer, key=trainer_key, keep=3)
        boot = (origin.node.advertised_multiaddrs()[0],)
        fetcher = await start_peer(nursery, tmp_path, 1, trainer=trainer, bootstrap=boot, follow=False)
        with trio.fail_after(60):
            full0 = (await origin.swarm.publish(steps[0], step=0, piece_size=PIECE)).full
            delta1 = (await origin.swarm.publish(steps[1], step=1, delta_base=steps[0])).delta
            delta2 = (await origin.swarm.publish(steps[2], step=2, delta_base=steps[1])).delta
            assert delta1 is not None and delta2 is not None
            await fetcher.swarm.fetch(full0.id())
            await fetcher.swarm.get_manifest(delta1.id())  # the chain's first link is known
            before = fetcher.swarm.dataplane.bytes_in
            path = await fetcher.swarm.fetch(delta2.id())
        assert read_tree(path) == read_tree(steps[2])
        assert path == fetcher.swarm.locate(2)
        status = fetcher.swarm.status()
        assert status["reconstructions"] == 2  # step 1, then step 2: no full version fetched
        assert fetcher.swarm.locate(1) is not None
        assert fetcher.swarm.dataplane.bytes_in - before < delta1.total_size + delta2.total_size + (256 << 10)
        # A fetcher holding nothing gets the full version the delta produces.
        empty = await start_peer(nursery, tmp_path, 2, trainer=trainer, bootstrap=boot, follow=False)
        with trio.fail_after(60):
            out = await empty.swarm.fetch(delta2.id(), out=tmp_path / "out")
        assert out == tmp_path / "out" and read_tree(out) == read_tree(steps[2])
        assert empty.swarm.status()["reconstructions"] == 0
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("tampering", ["other_target", "other_base"])
async def test_a_trainer_signed_delta_that_rebuilds_other_bytes_is_refused_and_the_full_version_fetched(
    tmp_path: Path, tampering: str, caplog: pytest.LogCaptureFixture
) -> None:
    steps = model_steps(tmp_path, 2)
    other = evolve(steps[0], tmp_path / "other", seed=77)
    trainer_key = WalletKey.generate()
    trainer = trainer_key.address
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer, key=trainer_key, keep=3)
        boot = (origin.node.advertised_multiaddrs()[0],)
        follower = await start_peer(nursery, tmp_path, 1, trainer=trainer, bootstrap=boot, keep=3)
        with trio.fail_after(60):
            full0 = (await origin.swarm.publish(steps[0], step=0, piece_size=PIECE)).full
            await follower.swarm.wait_newer(None)
            # The trainer holds step 1's full version and announces a delta it signed that claims to
            # produce it but encodes other content (or was encoded against another base).
            swarm = origin.swarm
            full1 = build_checkpoint(steps[1], trainer_key, run="test", step=1, now_ms=1, piece_size=PIECE)
            base_dir, target_dir = (steps[0], other) if tampering == "other_target" else (other, steps[1])
            bad, _ = encode_delta_version(
                base_dir, target_dir, swarm.layout.checkpoints, trainer_key,
                full=full1.manifest, base_id=full0.id(), now_ms=1, max_bytes=1 << 30,
            )  # fmt: skip
            assert bad is not None
            await swarm.publisher.announce(bad.manifest, bad.envelope)
            swarm.publisher.hold_delta(bad.manifest, bad.envelope, bad.directory)  # as publish: delta first
            source = OriginDirectory(steps[1], full1.manifest)
            swarm._hold(swarm.holdings.add(full1.manifest, full1.envelope, source, store=None,
                                           path=steps[1], origin=True))  # fmt: skip
            with caplog.at_level(logging.ERROR, logger="prime_node.swarm.service"):
                got, path = await follower.swarm.wait_newer(0)
        assert got == 1 and read_tree(path) == read_tree(steps[1])
        status = follower.swarm.status()
        assert (status["bad_deltas"], status["reconstructions"]) == (1, 0)
        assert any("bad_delta" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
        assert bad.manifest_id not in follower.swarm.versions  # neither kept nor served
        assert leftovers(follower.swarm) == []
        assert trainer not in follower.swarm.dataplane.banned
        nursery.cancel_scope.cancel()


async def test_a_restarted_follower_restores_its_fulls_and_deltas_and_rebuilds_the_next_step(
    tmp_path: Path,
) -> None:
    steps = model_steps(tmp_path, 4)
    trainer_key = WalletKey.generate()
    trainer = trainer_key.address
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer, key=trainer_key, keep=2)
        boot = (origin.node.advertised_multiaddrs()[0],)
        follower = await start_peer(nursery, tmp_path, 1, trainer=trainer, bootstrap=boot, keep=2)
        with trio.fail_after(90):
            await origin.swarm.publish(steps[0], step=0, piece_size=PIECE)
            await follower.swarm.wait_newer(None)
            for step in (1, 2):
                await origin.swarm.publish(
                    steps[step], step=step, delta_base=steps[step - 1], piece_size=PIECE
                )
                await follower.swarm.wait_newer(step - 1)
            held = sorted((v["step"], v["kind"]) for v in follower.swarm.status()["versions"])
            follower.scope.cancel()
            await trio.sleep(0.5)
            back = await start_on_store(
                nursery, tmp_path, 5, follower.swarm.store_dir, trainer=trainer, bootstrap=boot, keep=2
            )
            restored = sorted((v["step"], v["kind"]) for v in back.swarm.status()["versions"])
            assert restored == held == [(1, "delta"), (1, "full"), (2, "delta"), (2, "full")]
            assert read_tree(back.swarm.locate(2) or tmp_path) == read_tree(steps[2])
            await origin.swarm.publish(steps[3], step=3, delta_base=steps[2], piece_size=PIECE)
            got, path = await back.swarm.wait_newer(2)
        assert got == 3 and read_tree(path) == read_tree(steps[3])
        assert back.swarm.status()["reconstructions"] == 1
        nursery.cancel_scope.cancel()


async def test_a_chain_beyond_eight_links_ends_in_the_full_version(tmp_path: Path) -> None:
    steps = model_steps(tmp_path, 11)
    trainer_key = WalletKey.generate()
    trainer = trainer_key.address
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer, key=trainer_key, keep=20)
        boot = (origin.node.advertised_multiaddrs()[0],)
        fetcher = await start_peer(nursery, tmp_path, 1, trainer=trainer, bootstrap=boot, follow=False)
        with trio.fail_after(90):
            published = [await origin.swarm.publish(steps[0], step=0, piece_size=PIECE)]
            await fetcher.swarm.fetch(published[0].full.id())
            for step in range(1, 11):
                shared = await origin.swarm.publish(
                    steps[step], step=step, delta_base=steps[step - 1], piece_size=PIECE
                )
                assert shared.delta is not None
                await fetcher.swarm.get_manifest(shared.delta.id())  # every link is known
                published.append(shared)
            last = published[-1].delta
            assert last is not None
            path = await fetcher.swarm.fetch(last.id())
        assert read_tree(path) == read_tree(steps[10])
        assert fetcher.swarm.status()["reconstructions"] == 0  # 10 links from step 0: fetched whole
        assert fetcher.swarm.locate(9) is None
        nursery.cancel_scope.cancel()


async def test_deltas_signed_in_a_circle_neither_hang_nor_loop(tmp_path: Path) -> None:
    """Step 2 from step 1, and a "step 1" from step 2: a peer holding neither full version fetches the
    full version instead of waiting for itself."""
    steps = model_steps(tmp_path, 3)
    trainer_key = WalletKey.generate()
    trainer = trainer_key.address
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer, key=trainer_key, keep=5)
        boot = (origin.node.advertised_multiaddrs()[0],)
        swarm = origin.swarm
        with trio.fail_after(60):
            full = {s: (await swarm.publish(steps[s], step=s, piece_size=PIECE)).full for s in (1, 2)}
        circle = []
        for step, base_dir, target_dir, base, target in (
            (2, steps[1], steps[2], full[1], full[2]),
            (1, steps[2], steps[1], full[2], full[1]),
        ):
            work = tmp_path / f"circle{step}"
            work.mkdir()
            shared, _ = encode_delta_version(
                base_dir,
                target_dir,
                work,
                trainer_key,
                full=target,
                base_id=base.id(),
                now_ms=1,
                max_bytes=1 << 30,
            )
            assert shared is not None
            assert swarm.publisher.hold_delta(shared.manifest, shared.envelope, shared.directory)
            circle.append(shared.manifest)
        other = await start_peer(nursery, tmp_path, 1, trainer=trainer, bootstrap=boot, follow=False)
        with trio.fail_after(60):
            for manifest in circle:
                await other.swarm.get_manifest(manifest.id())
            path = await other.swarm.fetch(circle[0].id())
        assert read_tree(path) == read_tree(steps[2])
        assert other.swarm.status()["reconstructions"] == 0
        nursery.cancel_scope.cancel()


async def test_a_peer_fetches_the_oldest_of_more_versions_than_it_remembers_offers_for(
    tmp_path: Path,
) -> None:
    """With deltas a holder offers twice as many versions. A neighbour remembers at most
    MAX_OFFERS_PER_PEER offers of versions it does not hold, so it forgot the holder's offer of the
    oldest; its own offer, once it fetches that version, must still open the session on both sides."""
    trainer_key = WalletKey.generate()
    trainer = trainer_key.address
    count = MAX_OFFERS_PER_PEER + 4
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer, key=trainer_key, keep=count)
        boot = (origin.node.advertised_multiaddrs()[0],)
        with trio.fail_after(60):
            shared = [
                await origin.swarm.share(
                    write_model_dir(tmp_path / f"m{s}", weight_bytes=32 << 10, seed=s),
                    step=s,
                    piece_size=4 << 10,
                )
                for s in range(count)
            ]
        late = await start_peer(nursery, tmp_path, 1, trainer=trainer, bootstrap=boot, follow=False)
        with trio.fail_after(30):
            while origin.node.key.address not in late.swarm.dataplane.links:
                await trio.sleep(0.05)
            await trio.sleep(0.5)  # every offer has arrived: the oldest were forgotten
            path = await late.swarm.fetch(shared[0].id())
        assert read_tree(path) == read_tree(tmp_path / "m0")
        nursery.cancel_scope.cancel()


async def test_a_rebuild_cut_short_by_a_restart_is_done_again(tmp_path: Path) -> None:
    """The delta is held but its full version is not (killed between the two): after a restart the
    follower rebuilds it from the base it kept."""
    steps = model_steps(tmp_path, 2)
    trainer_key = WalletKey.generate()
    trainer = trainer_key.address
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer, key=trainer_key, keep=2)
        boot = (origin.node.advertised_multiaddrs()[0],)
        follower = await start_peer(nursery, tmp_path, 1, trainer=trainer, bootstrap=boot, keep=2)
        with trio.fail_after(60):
            await origin.swarm.publish(steps[0], step=0, piece_size=PIECE)
            await follower.swarm.wait_newer(None)
            shared = await origin.swarm.publish(steps[1], step=1, delta_base=steps[0], piece_size=PIECE)
            await follower.swarm.wait_newer(0)
        follower.scope.cancel()
        await trio.sleep(0.5)
        store = follower.swarm.store_dir
        shutil.rmtree(store / "checkpoints" / f"step-1-{shared.full.id().hex()[:16]}")
        (store / "manifests" / f"{shared.full.id().hex()}.envelope").unlink()
        (store / "checkpoints" / ".step-1-interrupted.rebuild-x").mkdir()  # a killed rebuild's work dir
        with trio.fail_after(60):
            back = await start_on_store(nursery, tmp_path, 5, store, trainer=trainer, bootstrap=boot, keep=2)
            got, path = await back.swarm.wait_newer(0)
        assert got == 1 and read_tree(path) == read_tree(steps[1])
        assert back.swarm.status()["reconstructions"] == 1
        assert leftovers(back.swarm) == []
        nursery.cancel_scope.cancel()
