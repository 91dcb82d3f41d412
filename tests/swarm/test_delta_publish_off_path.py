"""Issue 32: a slow delta never delays a policy. ``publish`` announces the full version once it stops
waiting for the delta (``delta_wait``) and announces the delta, encoded in the background, when it is
ready (for peers that had not started on the full version). A delta ready in time is announced instead
of the full version, as before."""

from __future__ import annotations

from pathlib import Path

import trio

from crypto.keys import WalletKey
from prime_node.swarm.delta_versions import Published
from tests.swarm.network_helpers import start_peer
from tests.swarm.test_delta_swarm import PIECE, leftovers, model_steps


async def test_a_late_delta_is_announced_after_the_full_version(tmp_path: Path) -> None:
    steps = model_steps(tmp_path, 2)
    trainer_key = WalletKey.generate()
    trainer = trainer_key.address
    outcomes: list[Published] = []
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer, key=trainer_key, keep=3)
        boot = (origin.node.advertised_multiaddrs()[0],)
        follower = await start_peer(nursery, tmp_path, 1, trainer=trainer, bootstrap=boot, keep=3)
        with trio.fail_after(90):
            await origin.swarm.publish(steps[0], step=0, piece_size=PIECE)
            await follower.swarm.wait_newer(None)
            late = await origin.swarm.publish(
                steps[1],
                step=1,
                delta_base=steps[0],
                piece_size=PIECE,
                delta_wait=0,
                on_delta=outcomes.append,
            )
            # announced at once as the full version; the delta is still being encoded
            assert (late.reason, late.delta, late.announced) == ("encoding", None, late.full)
            assert origin.swarm.locate(1) == steps[1]
            while not outcomes:
                await trio.sleep(0.05)
            (done,) = outcomes
            assert done.reason == "delta" and done.delta is not None
            assert (done.full, done.delta.target) == (late.full, late.full.id())
            assert 0 < done.delta_bytes < 0.5 * done.full_bytes
            got, _ = await follower.swarm.wait_newer(0)
            assert got == 1
            kinds = sorted((v["step"], v["kind"]) for v in origin.swarm.status()["versions"])
            assert kinds == [(0, "full"), (1, "delta"), (1, "full")]
        assert leftovers(origin.swarm) == []
        nursery.cancel_scope.cancel()


async def test_a_delta_ready_in_time_is_announced_instead_of_the_full_version(tmp_path: Path) -> None:
    steps = model_steps(tmp_path, 2)
    trainer_key = WalletKey.generate()
    outcomes: list[Published] = []
    async with trio.open_nursery() as nursery:
        origin = await start_peer(nursery, tmp_path, 0, trainer=trainer_key.address, key=trainer_key)
        with trio.fail_after(60):
            await origin.swarm.publish(steps[0], step=0, piece_size=PIECE)
            shared = await origin.swarm.publish(
                steps[1], step=1, delta_base=steps[0], piece_size=PIECE, on_delta=outcomes.append
            )
        assert shared.reason == "delta" and shared.announced == shared.delta
        assert outcomes == []  # publish itself reported it
        nursery.cancel_scope.cancel()
