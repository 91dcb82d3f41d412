"""The trainer's demand over real libp2p hosts on 127.0.0.1 (issue 38): a node believes the run trainer's
demands and nothing else; a forged demand and a replayed one, gossiped by a third node, change nothing."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any

import trio
import trio.testing

from crypto.keys import WalletKey
from prime_node.node.context import NodeContext
from prime_node.node.gossip import Delivered
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.roles.demand import DemandPublisher, DemandView
from prime_node.roles.demand_plan import plan_demand
from protocol.codec import encode
from protocol.demand import Demand, seal_demand
from protocol.topics import DEMAND_TOPIC
from tests.p2p.helpers import make_config, start_node, wait_until

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")
RUN_ID = "demandgossip"


class Forger:
    """A node that keeps every demand frame it hears and gossips what the test tells it to."""

    def __init__(self) -> None:
        self.heard: list[bytes] = []
        self.context: NodeContext | None = None

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async def keep(message: Delivered) -> None:
            self.heard.append(message.payload)

        await context.gossip.subscribe(DEMAND_TOPIC, keep)
        self.context = context
        task_status.started()

    async def gossip(self, frame: bytes) -> None:
        assert self.context is not None
        await self.context.gossip.publish(DEMAND_TOPIC, frame)


def test_plan_demand_raises_the_floor_by_the_queue_and_wants_what_is_not_had() -> None:
    floor, wanted, fresh = plan_demand(
        step=10, async_level=4, have={6: 1, 8: 2, 10: 1}, queued_steps=0, depth=5
    )
    # Each policy not had is wanted once; the room left (5 steps' worth, nothing queued or heard) goes
    # to the newest policy: a batch per step, not per policy.
    assert (floor, wanted, fresh) == (6, (0, 1, 0, 1, 3), 1)
    floor, wanted, fresh = plan_demand(step=10, async_level=4, have={}, queued_steps=3, depth=5)
    assert (floor, wanted, fresh) == (9, (1, 1), 1)  # a batch arriving now is trained three steps on
    floor, wanted, _ = plan_demand(step=10, async_level=4, have={}, queued_steps=9, depth=20)
    assert (floor, len(wanted)) == (10, 1)  # never above the newest policy
    assert plan_demand(step=1, async_level=4, have={}, queued_steps=0, depth=5) == (0, (1, 4), 1)


def test_plan_demand_fills_the_queue_to_its_depth_newest_policies_first() -> None:
    assert plan_demand(step=10, async_level=4, have={}, queued_steps=0, depth=2) == (6, (0, 0, 0, 1, 1), 1)
    assert plan_demand(step=10, async_level=4, have={10: 1}, queued_steps=1, depth=2) == (
        7,
        (0, 0, 1, 0),
        1,
    )
    # A full queue wants nothing, not even of the policies to come: the inferers wait.
    assert plan_demand(step=10, async_level=4, have={9: 1, 10: 1}, queued_steps=2, depth=2) == (
        8,
        (0, 0, 0),
        0,
    )


def test_with_every_policy_had_the_room_left_wants_the_newest_again_until_it_is_heard() -> None:
    """A lone inferer's trap (issue 38): its one batch of the newest policy is trained, every policy
    down to the floor is had, and each policy was wanted once, so nothing was wanted until the next
    policy was out: one batch at a time. The trainer takes a batch per step, not per policy."""
    had = {policy: 1 for policy in range(6, 11)}
    assert plan_demand(step=10, async_level=4, have=had, queued_steps=0, depth=2) == (6, (0, 0, 0, 0, 2), 1)
    # Heard announced (the count is exact): wanted no more.
    heard = plan_demand(step=10, async_level=4, have=had, queued_steps=0, depth=2, coming={10: 2})
    assert heard == (6, (0, 0, 0, 0, 0), 1)
    # Queued: a step's worth takes a step of room.
    assert plan_demand(step=10, async_level=4, have=had, queued_steps=1, depth=2)[1] == (0, 0, 0, 1)
    # Policy 10 trained but not shared yet: no inferer holds it, the newest shared one can fill the room.
    assert plan_demand(step=10, async_level=4, have=had, queued_steps=0, depth=2, shared=9)[1] == (
        0,
        0,
        0,
        2,
        0,
    )
    # Nothing shared at or above the floor: the floor's policy, the oldest the trainer takes.
    assert plan_demand(step=10, async_level=4, have=had, queued_steps=0, depth=2, shared=3)[1][0] == 2


async def test_only_the_trainers_demand_is_believed_and_forged_or_replayed_ones_change_nothing(
    tmp_path: Path,
) -> None:
    trainer_key, follower_key, forger_key = (WalletKey.generate() for _ in range(3))
    wants = {"step": 3, "floor": 1}
    publisher = DemandPublisher(
        key=trainer_key,
        run_id=RUN_ID,
        current=lambda: (wants["step"], wants["floor"], (1,) * (wants["step"] - wants["floor"] + 1), 400, 1),
        period_s=0.5,
        min_interval_s=0.05,
    )
    view = DemandView(RUN_ID, trainer_key.address)
    forger = Forger()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            trainer, _ = await start_node(
                nursery,
                OPEN,
                make_config(tmp_path, 0, run_id=RUN_ID),
                key=trainer_key,
                services=[publisher],
                serve_api=False,
            )
            boot = (trainer.advertised_multiaddrs()[0],)
            for index, (key, service) in enumerate(((follower_key, view), (forger_key, forger)), start=1):
                await start_node(
                    nursery,
                    OPEN,
                    make_config(tmp_path, index, run_id=RUN_ID, bootstrap=boot),
                    key=key,
                    services=[service],
                    serve_api=False,
                )
            await wait_until(lambda: view.floor() == 1 and len(forger.heard) >= 2, timeout=60)
            first = forger.heard[0]
            # The trainer's wants change: the follower hears the new floor.
            wants.update(step=5, floor=4)
            publisher.changed()
            await wait_until(lambda: view.floor() == 4, timeout=30)
            believed = view.current()
            assert believed is not None and believed.step == 5
            # A forged demand (signed by the forger, a higher sequence, a floor that would stop every
            # inferer) and the trainer's own first demand gossiped again.
            forged = Demand(
                run_id=RUN_ID,
                sequence=believed.sequence + 10**9,
                step=9,
                floor=9,
                wanted=(0,),
                step_ms=1,
                fresh=0,
            )
            assert forger.context is not None
            await forger.gossip(
                encode(seal_demand(forger_key, forged, now_ms=forger.context.clock.wall_ms()))
            )
            await forger.gossip(first)
            await wait_until(lambda: {"untrusted_trainer", "replayed"} <= set(view.book.refused), timeout=30)
            current = view.current()
            assert current is not None and (current.step, current.floor) == (5, 4)
            assert view.floor() == 4
            nursery.cancel_scope.cancel()


class _RecordingGossip:
    """The publisher's view of gossip: subscribing does nothing, publishing records the virtual time."""

    def __init__(self) -> None:
        self.published_at: list[float] = []

    async def subscribe(self, topic: str, handler: Any) -> None:
        return None

    async def publish(self, topic: str, frame: bytes) -> None:
        self.published_at.append(trio.current_time())


class _TrioWallClock:
    def wall_ms(self) -> int:
        return 1_700_000_000_000 + int(trio.current_time() * 1000)


async def test_a_change_after_a_quiet_spell_goes_out_at_once_and_a_burst_is_rate_limited(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The demand is a rate limit, not a delay: a lone inferer waits on each change (before, every change
    went out ``min_interval_s`` late, a fifth of a step in the demo)."""
    gossip = _RecordingGossip()
    context: Any = type("Context", (), {"gossip": gossip, "clock": _TrioWallClock()})()
    wants = {"step": 3}
    publisher = DemandPublisher(
        key=WalletKey.generate(),
        run_id=RUN_ID,
        current=lambda: (wants["step"], wants["step"], (1,), 100, 1),
        period_s=2.0,
        min_interval_s=0.2,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run, context)
        await trio.sleep(1.0)  # quiet: only the first demand went out
        assert len(gossip.published_at) == 1
        changed_at = trio.current_time()
        wants["step"] = 4
        publisher.changed()
        await trio.sleep(0.01)
        assert gossip.published_at[1] - changed_at < 0.01
        for step in range(5, 10):  # a burst of changes: at most one demand per interval
            wants["step"] = step
            publisher.changed()
            await trio.sleep(0.02)
        await trio.sleep(1.0)
        burst = gossip.published_at[1:]
        assert all(b - a >= 0.2 - 1e-9 for a, b in itertools.pairwise(burst))
        assert publisher.last is not None and publisher.last.step == 9  # the last change went out too
        nursery.cancel_scope.cancel()
