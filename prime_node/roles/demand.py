"""The trainer's demand on the network, gossiped (issue 38; the message and its rules: protocol/demand.py;
what the trainer wants: roles/demand_plan.py).

Trainer side: ``DemandPublisher`` signs and gossips what ``TrainerWants.current`` says on topic
``demand`` when it changes (at most every ``min_interval_s``: a rate limit after a publish, not a delay
before one, gossip's own publish limit being 10 messages/s per topic) and every ``period_s`` (gossip is
lossy and a late joiner must learn it).

Worker side: ``DemandView`` believes only demands signed by the run's trainer (the pinned one, whose run
announcement the node follows), newest sequence only, and answers ``floor()`` (the floor as the trainer
last published it; None when no live demand was heard: then nothing changes), ``should_start`` (for
inferers) and ``wait_changed``. One view per node, shared by the role's services.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from crypto.keys import Address, WalletKey
from prime_node.errors import NodeError
from protocol.codec import encode
from protocol.demand import (
    MAX_HEARD,
    MAX_STEP_MS,
    MAX_WANT,
    MAX_WANTED,
    Demand,
    DemandBook,
    Heard,
    Start,
    seal_demand,
)
from protocol.errors import ProtocolError
from protocol.topics import DEMAND_TOPIC

if TYPE_CHECKING:
    from prime_node.node.context import NodeContext
    from prime_node.node.gossip import Delivered

log = logging.getLogger(__name__)
DEMAND_PERIOD_S = 2.0
"""Seconds between the trainer's demand gossips when nothing changes."""
DEMAND_MIN_INTERVAL_S = 0.2
"""Seconds at least between two demand gossips."""
MAX_DEMAND_AGE_S = 15.0
"""A demand not renewed for this long counts as none heard (the trainer renews it every period)."""


class DemandPublisher:
    """Signs and gossips the trainer's demand (module doc). ``current`` returns what to say now."""

    def __init__(
        self,
        *,
        key: WalletKey,
        run_id: str,
        current: Callable[[], tuple[int, int, tuple[int, ...], int, int]],
        period_s: float = DEMAND_PERIOD_S,
        min_interval_s: float = DEMAND_MIN_INTERVAL_S,
        heard: Callable[[], tuple[Heard, ...]] = tuple,
    ) -> None:
        self.key = key
        self.run_id = run_id
        self.current = current
        """(step, floor, wanted, step_ms, fresh) now."""
        self.heard = heard
        """The demand's ``heard`` now (``heard_of``)."""
        self.period_s = period_s
        self.min_interval_s = min_interval_s
        self.published = 0
        self.last: Demand | None = None
        self._changed = trio.Event()
        self._sequence = 0

    def changed(self) -> None:
        """The trainer's wants may have changed: publish soon (rate limited)."""
        self._changed.set()

    def status(self) -> dict[str, Any]:
        last = self.last
        return {
            "published": self.published,
            "step": None if last is None else last.step,
            "floor": None if last is None else last.floor,
            "wanted": [] if last is None else list(last.wanted),
            "step_ms": None if last is None else last.step_ms,
        }

    def make(self, now_ms: int) -> Demand:
        step, floor, wanted, step_ms, fresh = self.current()
        self._sequence = max(self._sequence + 1, now_ms)  # rises across restarts with the wall clock
        return Demand(
            run_id=self.run_id,
            sequence=self._sequence,
            step=step,
            floor=floor,
            wanted=wanted[:MAX_WANTED],
            step_ms=max(0, min(MAX_STEP_MS, step_ms)),
            fresh=max(0, min(MAX_WANT, fresh)),
            heard=self.heard()[:MAX_HEARD],
        )

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async def ignore(message: Delivered) -> None:
            return None

        await context.gossip.subscribe(DEMAND_TOPIC, ignore)  # joins the mesh, so our publishes propagate
        task_status.started()
        while True:
            self._changed = trio.Event()
            demand = self.make(context.clock.wall_ms())
            if self.last is None or _wants_of(demand) != _wants_of(self.last) or self._due(context):
                await self._publish(context, demand)
                # A rate limit, not a delay: a change after a quiet spell goes out at once (a lone
                # inferer waits on each one), a burst at most one demand per interval.
                await trio.sleep(self.min_interval_s)
            with trio.move_on_after(self.period_s):
                await self._changed.wait()

    def _due(self, context: NodeContext) -> bool:
        return self.last is not None and context.clock.wall_ms() - self.last.sequence >= self.period_s * 1000

    async def _publish(self, context: NodeContext, demand: Demand) -> None:
        frame = encode(seal_demand(self.key, demand, now_ms=context.clock.wall_ms()))
        try:
            await context.gossip.publish(DEMAND_TOPIC, frame)
        except NodeError as exc:
            log.debug("demand not gossiped: %s", exc)
            return
        self.last = demand
        self.published += 1


def _wants_of(demand: Demand) -> tuple[int, int, tuple[int, ...], int, tuple[Heard, ...]]:
    return (demand.step, demand.floor, demand.wanted, demand.fresh, demand.heard)


class DemandView:
    """A node's read-only view of the trainer's demand (module doc)."""

    def __init__(self, run_id: str, trainer: Address, *, max_age_s: float = MAX_DEMAND_AGE_S) -> None:
        self.book = DemandBook(run_id, trainer, max_age_s=max_age_s)
        self._changed = trio.Event()

    def floor(self) -> int | None:
        """The lowest policy step the trainer still accepts, as it last said (None: no live demand)."""
        return self.book.floor(trio.current_time())

    def current(self) -> Demand | None:
        return self.book.live(trio.current_time())

    def should_start(
        self, policy_step: int, *, eta_s: float, in_flight: int, in_flight_total: int | None = None
    ) -> Start:
        return self.book.should_start(
            policy_step,
            now=trio.current_time(),
            eta_s=eta_s,
            in_flight=in_flight,
            in_flight_total=in_flight_total,
        )

    async def wait_changed(self) -> None:
        """Until the next believed demand."""
        await self._changed.wait()

    def offer(self, frame: bytes, *, now_ms: int, source: str = "?") -> Demand | None:
        """Feed one demand envelope frame; the demand if believed (a forged or replayed one: None)."""
        try:
            demand = self.book.offer(frame, now_ms=now_ms, now=trio.current_time())
        except ProtocolError as exc:
            log.debug("refused a demand from %s: %s", source, exc)
            return None
        self._changed.set()
        self._changed = trio.Event()
        return demand

    def status(self) -> dict[str, Any]:
        demand = self.current()
        return {
            "heard": self.book.believed,
            "refused": dict(self.book.refused),
            "step": None if demand is None else demand.step,
            "floor": None if demand is None else demand.floor,
            "wanted": [] if demand is None else list(demand.wanted),
        }

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async def on_demand(message: Delivered) -> None:
            self.offer(message.payload, now_ms=context.clock.wall_ms(), source=str(message.origin))

        await context.gossip.subscribe(DEMAND_TOPIC, on_demand)
        context.add_status_section("demand", self.status)
        task_status.started()
