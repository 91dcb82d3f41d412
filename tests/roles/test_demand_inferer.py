"""An inferer driven by the trainer's demand (issue 38): it starts a batch only when the trainer still
wants one of its policy and it will not arrive stale, and counts its own batches on their way.

The production loop (``InfererService._produce``) runs for real under trio's virtual clock; only the model
work (load, switch, generate) and the network publish are replaced by recorders."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import trio

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.roles.demand import DemandView
from prime_node.roles.inferer_service import InfererService
from protocol.codec import encode
from protocol.demand import Demand, seal_demand

RUN_ID = "demandinferer"
NOW_MS = 1_700_000_000_000


class Policies:
    """The weight swarm as an inferer sees it: the newest policy, and a wait for a newer one."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._newer = trio.Event()

    def newest(self) -> tuple[int, Path]:
        return self.step, Path("/nonexistent")

    async def wait_newer(self, than: int | None) -> tuple[int, Path]:
        while than is not None and self.step <= than:
            await self._newer.wait()
        return self.newest()

    def publish(self, step: int) -> None:
        self.step = step
        self._newer.set()
        self._newer = trio.Event()


class RecordingInferer(InfererService):
    """Model work and the network replaced: each batch takes ``GENERATE_S`` and is recorded."""

    GENERATE_S = 1.0

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.made: list[int] = []

    def _load(self, step: int, path: Path) -> None:
        self.policy_step = step

    def _switch(self, step: int, path: Path) -> None:
        self.policy_step = step

    def _make_frames(self, counter: int, now_ms: int) -> list[bytes]:
        return [counter.to_bytes(8, "big")]

    async def _publish(self, context: Any, frames: list[bytes]) -> None:
        for frame in frames:
            self.made.append(self.policy_step_or(-1))
            self._in_flight[frame] = trio.current_time()
            self._sent_policy[frame] = self.policy_step_or(-1)


def config(trainer: WalletKey) -> RunConfig:
    return RunConfig.model_validate(
        {"run_id": RUN_ID, "trainer_address": str(trainer.address), "async_level": 2}
    )


async def test_an_inferer_makes_what_the_demand_wants_and_waits_otherwise(mock_clock: Any) -> None:
    mock_clock.autojump_threshold = 0.05  # a worker thread's answer always comes before a jump
    trainer = WalletKey.generate()
    view = DemandView(RUN_ID, trainer.address)
    policies = Policies(5)
    inferer = RecordingInferer(
        key=WalletKey.generate(), run_config=config(trainer), swarm=policies, demand=view, policy_wait_s=0.5
    )
    context = SimpleNamespace(clock=SimpleNamespace(wall_ms=lambda: NOW_MS))
    sequence = 0

    def demand(step: int, floor: int, wanted: tuple[int, ...], step_ms: int = 10_000) -> None:
        nonlocal sequence
        sequence += 1
        d = Demand(
            run_id=RUN_ID, sequence=sequence, step=step, floor=floor, wanted=wanted, step_ms=step_ms, fresh=1
        )
        assert view.offer(encode(seal_demand(trainer, d, now_ms=NOW_MS)), now_ms=NOW_MS)

    # The trainer wants one batch of policy 5: exactly one is made, however long the inferer waits
    # (each wait is shorter than a demand lives: the trainer renews it every 2 s).
    demand(5, 3, (0, 0, 1))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inferer._produce, context)
        await trio.sleep(5)
        assert inferer.made == [5]
        assert inferer.held_back["wants_met"] >= 1
        # A newer demand wants one more of policy 5 (the first was refused, say), but the inferer's own
        # batch still awaits its verdict: it counts as on its way, and nothing more is made...
        demand(5, 3, (0, 0, 1))
        await trio.sleep(5)
        assert inferer.made == [5]
        # ... until its verdict came (a rejection: nothing accepted on its way).
        inferer._in_flight.clear()
        demand(5, 3, (0, 0, 1))
        await trio.sleep(5)
        assert inferer.made == [5, 5]
        # A newer policy than the demand knows: the trainer's fresh wants of it, one batch.
        inferer._in_flight.clear()
        demand(5, 3, (0, 0, 0))
        policies.publish(6)
        await trio.sleep(5)
        assert inferer.made == [5, 5, 6]
        # The trainer is at step 8, two steps a second: a batch of policy 6 that reaches it in a second
        # would be below the floor, so none is started though policy 6 is wanted...
        inferer._in_flight.clear()
        inferer.round_trip_mean_s = 1.0
        demand(8, 6, (1, 1, 1), step_ms=500)
        await trio.sleep(5)
        assert inferer.made == [5, 5, 6]
        assert inferer.held_back["would_be_stale"] >= 1
        # ... and the inferer re-aims at the newest policy as soon as it holds it.
        policies.publish(8)
        await trio.sleep(5)
        assert inferer.made == [5, 5, 6, 8]
        nursery.cancel_scope.cancel()


async def test_with_no_demand_heard_an_inferer_produces_as_before(mock_clock: Any) -> None:
    mock_clock.autojump_threshold = 0.05
    trainer = WalletKey.generate()
    policies = Policies(5)
    inferer = RecordingInferer(
        key=WalletKey.generate(),
        run_config=config(trainer),
        swarm=policies,
        demand=DemandView(RUN_ID, trainer.address),
        policy_wait_s=0.5,
        batches_per_policy=2,
    )
    context = SimpleNamespace(clock=SimpleNamespace(wall_ms=lambda: NOW_MS))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inferer._produce, context)
        await trio.sleep(10)
        # ``batches_per_policy`` of it, then one whenever a brief wait for a newer policy ends
        assert inferer.made[:2] == [5, 5] and len(inferer.made) > 2 and inferer.skipped_waits >= 1
        assert not inferer.held_back
        nursery.cancel_scope.cancel()
