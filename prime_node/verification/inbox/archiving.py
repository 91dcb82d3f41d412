"""The archive hook (``IntakeHooks.archive``) run beside the intake: once per batch id, in a worker thread,
at most ``pending`` at once (beyond, skipped and counted), so a slow disk never stalls gossip; an exception
from it is logged and counted, never stops intake."""

from __future__ import annotations

import functools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path

import trio

from prime_node.verification.inbox.terms import Archive
from protocol.rollouts import BatchHeader

log = logging.getLogger(__name__)
ARCHIVED_IDS = 4096


class Archiver:
    """Calls ``archive.keep`` for each new batch id (module doc); ``archived`` maps recent ids to paths."""

    def __init__(self, archive: Archive, *, pending: int, counts: Counter[str]) -> None:
        self.archive = archive
        self.pending = pending
        self.counts = counts
        self.archived: OrderedDict[bytes, Path | None] = OrderedDict()
        self._running = 0

    def start(self, nursery: trio.Nursery, frame: bytes, batch_id: bytes, header: BatchHeader) -> None:
        if batch_id in self.archived:
            return
        if self._running >= self.pending:
            self.counts["archive_skipped"] += 1
            return
        self.archived[batch_id] = None
        while len(self.archived) > ARCHIVED_IDS:
            self.archived.popitem(last=False)
        self._running += 1
        keep = functools.partial(
            self.archive.keep,
            frame,
            batch_id=batch_id.hex(),
            worker=str(header.worker),
            policy_step=header.policy_step,
        )
        nursery.start_soon(self._keep, batch_id, keep)

    async def _keep(self, batch_id: bytes, keep: Callable[[], Path | None]) -> None:
        try:
            path = await trio.to_thread.run_sync(keep)
        except Exception as exc:  # the archive is another's code on another's disk: never stop intake
            self.counts["archive_failed"] += 1
            log.warning("archiving batch %s failed: %s", batch_id.hex()[:16], exc)
        else:
            self.counts["archived"] += 1
            if batch_id in self.archived:
                self.archived[batch_id] = path
        finally:
            self._running -= 1
