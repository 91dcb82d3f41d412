"""The networked trainer's held-out evaluation, beside its step loop (DESIGN §6).

Held-out greedy accuracy of a policy, measured on the session's own evaluation engine in a worker thread
with one torch thread (a second full pool would steal the training's cores), at most one at a time: a
policy due while another is being evaluated is left out, and the last policy is always evaluated before
the run is done (``final``). It reads the policy's weights from its file (``TrainingSession.weights``),
so the next optimizer step cannot change what is measured.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from prime_node.ml.session import TrainingSession, Weights
    from prime_node.roles.trainer_publisher import Timing

log = logging.getLogger(__name__)


class HeldOutEvaluator:
    """See the module doc; ``held_out`` is the trainer's curve of ``[step, accuracy]``."""

    def __init__(self, *, eval_tasks: int, timing: Timing, held_out: list[list[float]]) -> None:
        self.eval_tasks = eval_tasks
        self.timing = timing
        self.held_out = held_out
        self._done: trio.Event | None = None
        """Set when the evaluation in flight ends (None: none is running)."""

    def start(self, nursery: trio.Nursery, session: TrainingSession, step: int) -> None:
        """Evaluate policy ``step`` in the background unless one is running (or nothing is to be held
        out)."""
        if self._done is not None or not self.eval_tasks:
            return
        self._done = trio.Event()
        nursery.start_soon(self._eval, session, step, session.weights(step))

    async def final(self, session: TrainingSession, step: int) -> None:
        """Wait for the evaluation in flight, then evaluate ``step`` unless it was the last measured."""
        if self._done is not None:
            await self._done.wait()
        if not self.held_out or self.held_out[-1][0] != step:
            self._done = trio.Event()
            await self._eval(session, step, session.weights(step))

    async def _eval(self, session: TrainingSession, step: int, weights: Weights) -> None:
        t0 = trio.current_time()
        try:
            accuracy = await trio.to_thread.run_sync(_evaluate, session, weights)
        finally:
            done, self._done = self._done, None
            if done is not None:
                done.set()
        self.timing.eval_s += trio.current_time() - t0
        self.held_out.append([step, round(accuracy, 4)])
        log.info("step %d: held-out greedy accuracy %.3f", step, accuracy)


def _evaluate(session: TrainingSession, weights: Weights) -> float:
    import torch

    torch.set_num_threads(1)  # runs beside training: a second full pool would steal its cores
    return session.evaluate(weights)
