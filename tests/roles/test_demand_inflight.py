"""An inferer counts as on their way only its own batches the trainer's demand cannot count yet (issue
38), and the demand's room counts the batches the trainer heard announced.

Before, each inferer counted its own batches awaiting a verdict and every accepted verdict heard since the
demand it acted on, and forgot those whenever a newer demand arrived, even one the trainer made before it
had the batches: so it made a batch too many. Now the trainer counts every batch it heard announced and
names, per worker, the newest batch counter it heard; the inferer counts its own batches above that mark
until a demand covers them (or a verdict rejects them, or they time out).

The production loop (``InfererService._produce``) and ``on_verdict`` run for real under trio's virtual
clock; the model work, the network publish and the verdict's signature check are replaced."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import trio
from hypothesis import given
from hypothesis import strategies as st

from crypto.keys import Address, WalletKey
from prime_node.config import RunConfig
from prime_node.roles.demand import DemandView
from prime_node.roles.demand_plan import plan_demand
from prime_node.roles.inferer_service import InfererService
from protocol.codec import encode
from protocol.demand import Demand, Heard, seal_demand
from protocol.verdict import Verdict
from tests.roles.test_demand_inferer import Policies

RUN_ID = "demandinflight"
NOW_MS = 1_700_000_000_000


class _Reputation:
    """The verdict's signature check stood in: the verdict as a trusted validator's."""

    def open(self, payload: Verdict) -> tuple[Verdict, Address]:
        return payload, WalletKey.generate().address

    def observe(self, verdict: Verdict) -> None:
        return None


class CountingInferer(InfererService):
    """Model work and the network replaced; each batch's id is its counter (32 bytes)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.made: list[tuple[int, int]] = []
        self._reputation = _Reputation()

    def _load(self, step: int, path: Path) -> None:
        self.policy_step = step

    def _switch(self, step: int, path: Path) -> None:
        self.policy_step = step

    def _make_frames(self, counter: int, now_ms: int) -> list[bytes]:
        return [counter.to_bytes(32, "big")]

    async def _publish(self, context: Any, frames: list[bytes]) -> None:
        for frame in frames:
            self.made.append((self.policy_step_or(-1), self._counter))
            self._in_flight[frame] = trio.current_time()
            self._sent_policy[frame] = self.policy_step_or(-1)
            self._sent_counter[frame] = self._counter

    async def verdict(self, counter: int, *, accepted: bool) -> None:
        verdict = Verdict(
            run_id=RUN_ID,
            batch_id=counter.to_bytes(32, "big"),
            worker=self.key.address,
            policy_step=5,
            batch_counter=counter,
            accepted=accepted,
            reasons=() if accepted else ("bad_proof",),
            rejected_samples=(),
            rewards=(),
            verified_groups=(0,) if accepted else (),
        )
        await self.on_verdict(SimpleNamespace(payload=verdict))  # type: ignore[arg-type]


async def test_an_inferer_keeps_counting_its_batches_until_a_demand_counts_them(mock_clock: Any) -> None:
    mock_clock.autojump_threshold = 0.05
    trainer, key = WalletKey.generate(), WalletKey.generate()
    view = DemandView(RUN_ID, trainer.address)
    config = RunConfig.model_validate(
        {"run_id": RUN_ID, "trainer_address": str(trainer.address), "async_level": 2}
    )
    inferer = CountingInferer(key=key, run_config=config, swarm=Policies(5), demand=view, policy_wait_s=0.5)
    context = SimpleNamespace(clock=SimpleNamespace(wall_ms=lambda: NOW_MS))
    sequence = 0

    def demand(wanted: tuple[int, ...], heard: tuple[Heard, ...] = ()) -> None:
        nonlocal sequence
        sequence += 1
        d = Demand(
            run_id=RUN_ID,
            sequence=sequence,
            step=5,
            floor=3,
            wanted=wanted,
            step_ms=10_000,
            fresh=1,
            heard=heard,
        )
        assert view.offer(encode(seal_demand(trainer, d, now_ms=NOW_MS)), now_ms=NOW_MS)

    demand((0, 0, 1))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inferer._produce, context)
        await trio.sleep(5)
        assert [p for p, _ in inferer.made] == [5]
        first = inferer.made[0][1]
        # Its verdict: accepted. A newer demand still wants one of policy 5, but the trainer made it
        # before it heard of the batch (no mark for this worker): the batch is still on its way.
        await inferer.verdict(first, accepted=True)
        demand((0, 0, 1))
        await trio.sleep(5)
        assert [p for p, _ in inferer.made] == [5]  # before: forgotten with the older demand, a second made
        assert inferer.in_flight_of(5) == 1
        # The trainer heard it (its mark covers the counter) and wants one more: counted there, not here.
        demand((0, 0, 1), (Heard(key.address, first),))
        await trio.sleep(5)
        assert [p for p, _ in inferer.made] == [5, 5]
        second = inferer.made[1][1]
        # No verdict yet on the second, but a demand that heard it and still wants one: a third is made
        # (before, every own batch awaiting its verdict counted, whatever the trainer had counted).
        demand((0, 0, 1), (Heard(key.address, second),))
        await trio.sleep(5)
        assert [p for p, _ in inferer.made] == [5, 5, 5]
        third = inferer.made[2][1]
        # A batch above the mark that a validator rejects is not on its way any more.
        assert inferer.in_flight_of(5) == 1
        await inferer.verdict(third, accepted=False)
        assert inferer.in_flight_of(5) == 0
        nursery.cancel_scope.cancel()


WANTS = st.dictionaries(st.integers(0, 12), st.integers(0, 3), max_size=8)


@given(
    st.integers(0, 12),
    st.integers(1, 5),
    WANTS,
    WANTS,
    st.integers(0, 4),
    st.integers(1, 5),
    st.none() | st.integers(0, 12),
)
def test_batches_heard_announced_are_had_and_take_room_but_never_raise_the_floor(
    step: int,
    level: int,
    have: dict[int, int],
    coming: dict[int, int],
    queued: int,
    depth: int,
    shared: int | None,
) -> None:
    floor, wanted, fresh = plan_demand(
        step=step,
        async_level=level,
        have=have,
        queued_steps=queued,
        depth=depth,
        coming=coming,
        shared=shared,
    )
    newest = step if shared is None else max(floor, min(step, shared))
    assert floor == plan_demand(step=step, async_level=level, have=have, queued_steps=queued)[0]
    heard = sum(n for p, n in coming.items() if floor <= p <= step)  # takeable only, never the last step
    room = max(0, depth - queued - min(heard, depth - 1))
    assert sum(wanted) <= room and fresh <= room
    for i, want in enumerate(wanted):
        policy = floor + i
        once = max(0, 1 - have.get(policy, 0) - coming.get(policy, 0))
        if want > once:  # only the newest an inferer holds, with every heard batch counted and room left
            assert policy == newest and queued + heard + sum(wanted) <= depth
    if not coming:
        assert (floor, wanted, fresh) == plan_demand(
            step=step, async_level=level, have=have, queued_steps=queued, depth=depth, shared=shared
        )


def test_batches_heard_for_a_policy_not_made_yet_take_no_room() -> None:
    """A flood of frames claiming the step after the newest (never judged, counted as heard) must not
    fill the demand's room: the trainer would want nothing and starve (the short demo's flood did)."""
    plain = plan_demand(step=5, async_level=4, have={}, queued_steps=0, depth=2)
    flooded = plan_demand(step=5, async_level=4, have={}, queued_steps=0, depth=2, coming={6: 4, 9: 4})
    assert flooded == plain and sum(plain[1]) > 0
