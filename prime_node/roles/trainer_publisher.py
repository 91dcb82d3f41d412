"""The trainer's one policy writer: each trained policy written and shared off the step path (issue 38).

The step loop hands every policy it trains to ``PolicyPublisher.offer`` and starts its next step at once;
one task (``run``) writes the newest policy offered (``OUT/policies/step_N``, hard links to the file the
step itself wrote in the published dtype: an immutable snapshot whatever the next optimizer step does,
``TrainingSession.publish_policy``) and shares it through the weight swarm. Newest wins: a policy offered
while another is being shared waits, and is replaced by a newer one offered before it starts (inferers
want the newest policy; an older one would only delay it). A skipped policy breaks no delta chain: each
delta is against the last policy actually shared, and a full snapshot is due whenever a multiple of
``delta_snapshot_every`` lies between the two. ``flush`` waits until the newest policy offered is out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from prime_node.errors import NodeError
from prime_node.node.stage_times import StageTimes
from prime_node.roles.publish_stats import PublishStats

if TYPE_CHECKING:
    from prime_node.config import RunConfig
    from prime_node.swarm.delta_versions import Published

log = logging.getLogger(__name__)


class Sharer(Protocol):
    """The part of the weight swarm the trainer uses (``prime_node.swarm.service.SwarmService``)."""

    async def publish(
        self,
        directory: Path,
        *,
        step: int,
        delta_base: Path | None = None,
        snapshot: bool = False,
        max_delta_share: float = 0.5,
    ) -> Published: ...


@dataclass
class Timing:
    """Where the trainer's wall time goes (seconds), for benchmarks and the status section. ``write_s``
    and ``share_s`` are the publisher's, beside the steps (``train_s``), not in front of them."""

    waiting_s: float = 0.0
    train_s: float = 0.0
    write_s: float = 0.0
    share_s: float = 0.0
    eval_s: float = 0.0


class PolicyPublisher:
    """See the module doc. ``write(step)``: the policy's directory (run in a worker thread);
    ``on_published(step)``: called once policy ``step`` is shared."""

    def __init__(
        self,
        *,
        config: RunConfig,
        swarm: Sharer,
        write: Callable[[int], Path],
        timing: Timing,
        stages: StageTimes,
        on_published: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.swarm = swarm
        self.write = write
        self.timing = timing
        self.stages = stages
        self.on_published = on_published
        self.stats = PublishStats()
        self.shared = 0
        """Policies shared (``checkpoints_shared`` in the trainer's status)."""
        self.skipped = 0
        """Policies replaced by a newer one before their turn came."""
        self.newest: int | None = None
        """The newest policy step shared (None: none yet)."""
        self.last_directory: Path | None = None
        """The directory of the policy shared last: the base of the next delta."""
        self._last_step: int | None = None
        self._pending: tuple[int, float] | None = None
        """(step, when it was trained) of the newest policy offered and not started yet."""
        self._busy = False
        self._wake = trio.Event()
        self._idle = trio.Event()
        self._idle.set()

    def offer(self, step: int, trained_at: float) -> None:
        """Policy ``step`` is trained: publish it once the one being shared is out (unless a newer one
        is offered before that). Never waits."""
        if self._pending is not None and self._pending[0] >= step:
            return
        if self._pending is not None:
            self.skipped += 1
        self._pending = (step, trained_at)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._wake.set()

    def status(self) -> dict[str, object]:
        return {**self.stats.summary(), "skipped": self.skipped, "newest": self.newest}

    async def run(self) -> None:
        """The one writer: publish the newest policy offered, one at a time, forever."""
        while True:
            if self._pending is None:
                self._idle.set()
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            step, trained_at = self._pending
            self._pending = None
            self._busy = True
            try:
                await self.publish(step)
            finally:
                self._busy = False
            self.stages.add("publish_lag", trio.current_time() - trained_at)

    async def flush(self) -> None:
        """Until every policy offered so far is published (or replaced by a newer one that is)."""
        while self._pending is not None or self._busy:
            await self._idle.wait()

    async def publish(self, step: int) -> None:
        """Write policy ``step``'s directory and share it (the start-up policy goes this way inline)."""
        t0 = trio.current_time()
        directory = await trio.to_thread.run_sync(self.write, step)
        t1 = trio.current_time()
        await self.share(directory, step)
        t2 = trio.current_time()
        self.timing.write_s += t1 - t0
        self.timing.share_s += t2 - t1
        self.stages.add("write_share", t2 - t0)
        if self.on_published is not None:
            self.on_published(step)

    async def share(self, directory: Path, step: int) -> None:
        """Share policy ``step``: a delta against the last policy shared, or a full snapshot when a
        multiple of ``delta_snapshot_every`` lies after it (every so many steps, skipped ones counted)
        and whenever the delta would not be small (the swarm decides)."""
        every = self.config.delta_snapshot_every
        base, last = self.last_directory, self._last_step
        snapshot = base is None or last is None or step // every > last // every
        try:
            published = await self.swarm.publish(
                directory,
                step=step,
                delta_base=base,
                snapshot=snapshot,
                max_delta_share=self.config.delta_max_share,
            )
        except NodeError as exc:
            log.warning("sharing policy %d failed: %s", step, exc)
            return
        self.last_directory, self._last_step = directory, step
        self.newest = step if self.newest is None else max(self.newest, step)
        self.shared += 1
        self.stats.add(published)
        log.info(
            "policy %d published as %s (%s): %d bytes on the wire of %d",
            step,
            "a delta" if published.delta is not None else "a full checkpoint",
            published.reason,
            published.delta_bytes if published.delta is not None else published.full_bytes,
            published.full_bytes,
        )
