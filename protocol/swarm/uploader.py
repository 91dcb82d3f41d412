"""Upload slots: how many pieces a node sends at once, and the queue of requests waiting for a slot.

Which waiting request gets a free slot: the one from the peer holding the fewest pieces (ties in arrival
order). Serving the laggards first keeps the swarm's peers at similar progress, so they finish close
together instead of leaving a long tail of a few peers still downloading while everyone else idles.

Few concurrent uploads (four by default, SwarmConfig.upload_slots) is a trade-off the simulator settled:
a piece sent alone at full upload rate is complete, and re-servable by its receiver, S times sooner than
S pieces sent side by side, which speeds the epidemic; but a single upload stalls whenever its receiver's
download link is saturated, which several uploads side by side absorb. Requests beyond the slots wait;
each peer may have only a bounded number of requests queued or active, so the queue's memory is bounded
by the number of connections.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from protocol.errors import InvariantError


class UploadScheduler:
    def __init__(self, *, slots: int, per_peer: int) -> None:
        if slots < 1 or per_peer < 1:
            raise InvariantError(
                "upload slots and the per-peer request cap must be positive", reason="bad_config"
            )
        self.slots = slots
        self.per_peer = per_peer
        self.active: set[tuple[Hashable, int]] = set()
        self.queue: dict[tuple[Hashable, int], None] = {}
        self.per_peer_count: dict[Hashable, int] = {}

    def request(self, peer: Hashable, index: int) -> bool:
        """Queue a request; False when ``peer`` already has as many as it may, or asked for this one."""
        key = (peer, index)
        count = self.per_peer_count.get(peer, 0)
        if count >= self.per_peer or key in self.queue or key in self.active:
            return False
        self.per_peer_count[peer] = count + 1
        self.queue[key] = None
        return True

    def start_ready(self, progress: Callable[[Hashable], int]) -> list[tuple[Hashable, int]]:
        """Move queued requests into free slots, least ``progress`` first; returns the uploads to start."""
        started = []
        while self.queue and len(self.active) < self.slots:
            key = min(self.queue, key=lambda k: progress(k[0]))
            del self.queue[key]
            self.active.add(key)
            started.append(key)
        return started

    def finished(self, peer: Hashable, index: int) -> bool:
        """An upload ended (sent or aborted). False if it was not active."""
        key = (peer, index)
        if key not in self.active:
            return False
        self.active.discard(key)
        self._release(peer)
        return True

    def cancel(self, peer: Hashable, index: int) -> bool:
        """Drop a request; True if its upload was already running (the caller aborts it)."""
        key = (peer, index)
        if key in self.queue:
            del self.queue[key]
            self._release(peer)
            return False
        if key in self.active:
            self.active.discard(key)
            self._release(peer)
            return True
        return False

    def drop_peer(self, peer: Hashable) -> list[int]:
        """Forget every request of ``peer``; returns the pieces whose uploads were running."""
        for key in [k for k in self.queue if k[0] == peer]:
            del self.queue[key]
        running = sorted(index for who, index in self.active if who == peer)
        for index in running:
            self.active.discard((peer, index))
        self.per_peer_count.pop(peer, None)
        return running

    def _release(self, peer: Hashable) -> None:
        count = self.per_peer_count[peer] - 1
        if count:
            self.per_peer_count[peer] = count
        else:
            del self.per_peer_count[peer]
