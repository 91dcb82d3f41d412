"""The trainer's demand over real libp2p hosts on 127.0.0.1 (issue 38): a node believes the run trainer's
demands and nothing else; a forged demand and a replayed one, gossiped by a third node, change nothing."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import trio

from crypto.keys import WalletKey
from prime_node.node.context import NodeContext
from prime_node.node.gossip import Delivered
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.roles.demand import DemandPublisher, DemandView, plan_demand
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
    assert (floor, wanted, fresh) == (6, (0, 1, 0, 1, 0), 1)
    floor, wanted, fresh = plan_demand(step=10, async_level=4, have={}, queued_steps=3, depth=5)
    assert (floor, wanted, fresh) == (9, (1, 1), 1)  # a batch arriving now is trained three steps on
    floor, wanted, _ = plan_demand(step=10, async_level=4, have={}, queued_steps=9, depth=20)
    assert (floor, wanted) == (10, (1,))  # never above the newest policy
    assert plan_demand(step=1, async_level=4, have={}, queued_steps=0, depth=5) == (0, (1, 1), 1)


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
