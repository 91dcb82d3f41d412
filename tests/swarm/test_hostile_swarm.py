"""Hostile peers against the weight swarm (issue 13), on real nodes: libp2p on 127.0.0.1 and
authenticated data-plane channels. Hoarders that never re-serve (item 5) and an offer flood (item 6)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from crypto.keys import WalletKey
from prime_node.testing.hoarder import HoardMode, hoard
from prime_node.testing.offer_flood import flood_offers
from prime_node.testing.swarm_fixtures import read_tree, write_model_dir
from tests.p2p.helpers import wait_until
from tests.swarm.network_helpers import Peer, start_peer

log = logging.getLogger(__name__)

HOARDERS = 6
WEIGHTS = 12 << 20
PIECE = 128 << 10


def linked(a: Peer, b: Peer) -> bool:
    return b.node.key.address in a.swarm.dataplane.links


async def timed_fetch(peer: Peer, mid: bytes, limit: float) -> tuple[float, Path]:
    start = trio.current_time()
    with trio.fail_after(limit):
        path = await peer.swarm.fetch(mid)
    return trio.current_time() - start, path


@pytest.mark.slow
@pytest.mark.parametrize("mode", [HoardMode.SIT, HoardMode.TAKE])
async def test_hoarders_that_never_re_serve_do_not_stall_an_honest_fetch(
    tmp_path: Path, mode: HoardMode
) -> None:
    """Issue 13 item 5: peers that sat on the pieces the super-seeding origin revealed to them (SIT), or
    took them and never served them on (TAKE), kept an honest fetch from finishing until they left."""
    trainer_key = WalletKey.generate()
    alone_model = write_model_dir(tmp_path / "alone", weight_bytes=WEIGHTS, seed=1)
    hoarded_model = write_model_dir(tmp_path / "hoarded", weight_bytes=WEIGHTS, seed=2)
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer_key.address, key=trainer_key)
        boot = (origin.node.advertised_multiaddrs()[0],)
        options = {"trainer": trainer_key.address, "bootstrap": boot, "follow": False}

        # The same nodes, first idle: the fetch without hoarders gives the bound under the same load.
        hoarders = [
            await start_peer(nursery, tmp_path, 10 + i, upload=False, **options)  # type: ignore[arg-type]
            for i in range(HOARDERS)
        ]
        alone = await start_peer(nursery, tmp_path, 1, **options)  # type: ignore[arg-type]
        honest = await start_peer(nursery, tmp_path, 2, **options)  # type: ignore[arg-type]
        await wait_until(lambda: all(linked(p, origin) for p in [alone, honest, *hoarders]), timeout=60)
        warm_up = await origin.swarm.share(
            write_model_dir(tmp_path / "warm", seed=3), step=0, piece_size=PIECE
        )
        await timed_fetch(alone, warm_up.id(), 60)  # the first fetch of a process pays start-up costs
        manifest = await origin.swarm.share(alone_model, step=1, piece_size=PIECE)
        baseline, path = await timed_fetch(alone, manifest.id(), 60)
        assert read_tree(path) == read_tree(alone_model)

        for peer in hoarders:
            hoard(peer.swarm, mode)
        manifest = await origin.swarm.share(hoarded_model, step=2, piece_size=PIECE)
        for peer in hoarders:
            nursery.start_soon(peer.swarm.fetch, manifest.id())
        origin_node = origin.swarm.versions[manifest.id()].transfer.node
        hoarder_keys = {p.node.key.address for p in hoarders}

        # The hoarders hold their sessions and the origin's first reveals before the honest fetch starts.
        def hoarding() -> bool:
            sessions = [origin_node.peers.get(key) for key in hoarder_keys]
            return all(s is not None and (s.revealed or s.sent) for s in sessions)

        await wait_until(hoarding, timeout=30, step=0.01)
        took, path = await timed_fetch(honest, manifest.id(), 60)
        assert read_tree(path) == read_tree(hoarded_model)
        log.warning("fetch alone %.2f s, with %d %s hoarders %.2f s", baseline, HOARDERS, mode.value, took)
        # Generous: ~7 nodes share this process and a loaded machine (the goal is 1.2 x; see the docs).
        assert took <= 2.0 * baseline + 3.0, (baseline, took)
        if mode is HoardMode.SIT:  # pieces revealed and never asked for reach others only once opened
            assert origin_node.open, "no piece was opened: the hoarders did not hoard"
        else:
            # Pieces taken and never passed on reach the honest peer once opened, or in the origin's
            # second reveal pass (every piece served once): a fast first pass leaves nothing to open, as
            # fresh-clone CI found once. That the takers took is what this run must show.
            takers = [origin_node.peers.get(key) for key in hoarder_keys]
            assert all(t is not None and t.sent for t in takers), "the hoarders took nothing"
        nursery.cancel_scope.cancel()


async def test_an_offer_flood_neither_breaks_fetches_nor_closes_honest_links(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 13 item 6: thousands of offers of made-up ids pushed the honest holder's offer out of the
    victim's table, so the victim's fetch of that version never opened its session and hung."""
    trainer_key = WalletKey.generate()
    first = write_model_dir(tmp_path / "first", weight_bytes=1 << 20, seed=1)
    second = write_model_dir(tmp_path / "second", weight_bytes=1 << 20, seed=2)
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer_key.address, key=trainer_key)
        boot = (origin.node.advertised_multiaddrs()[0],)
        victim = await start_peer(
            nursery, tmp_path, 1, trainer=trainer_key.address, bootstrap=boot, follow=False
        )
        await wait_until(lambda: linked(victim, origin), timeout=30)
        held = await origin.swarm.share(first, step=1, piece_size=64 << 10)
        with trio.fail_after(30):
            await victim.swarm.fetch(held.id())
        offered = await origin.swarm.share(second, step=2, piece_size=64 << 10)
        await wait_until(lambda: offered.id() in victim.swarm.catalogue.offers, timeout=10, step=0.01)
        origin_link = victim.swarm.dataplane.links[origin.node.key.address]
        caplog.set_level(logging.WARNING, logger="prime_node.swarm.transport")

        answers = await flood_offers(
            "127.0.0.1", victim.swarm.bound_port, victim.node.key.address, count=6000, seconds=30
        )
        assert answers <= 64  # manifest requests for a few of its ids, not one per offer

        with trio.fail_after(30):
            path = await victim.swarm.fetch(offered.id())
        assert read_tree(path) == read_tree(second)
        assert victim.swarm.dataplane.links.get(origin.node.key.address) is origin_link, (
            "an honest link closed"
        )
        # An honest fetch from the victim alone (the origin gone) completes too.
        origin.scope.cancel()
        fetcher = await start_peer(
            nursery,
            tmp_path,
            2,
            trainer=trainer_key.address,
            bootstrap=(victim.node.advertised_multiaddrs()[0],),
            follow=False,
        )
        with trio.fail_after(60):
            path = await fetcher.swarm.fetch(held.id())
        assert read_tree(path) == read_tree(first)
        assert not [r for r in caplog.records if "send queue is full" in r.getMessage()]
        nursery.cancel_scope.cancel()
