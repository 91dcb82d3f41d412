"""An in-memory transport for CheckpointTransfer: frames queue in order and are delivered one at a time,
so several transfers (an origin, fetchers with real PieceStores on disk, a misbehaving peer) can move a
real checkpoint between them in a test without a network."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

from prime_node.swarm.transfer import CheckpointTransfer

FrameFilter = Callable[[bytes], bytes]


class LoopbackSwarm:
    def __init__(self) -> None:
        self.transfers: dict[str, CheckpointTransfer] = {}
        self.links: set[frozenset[str]] = set()
        self.queue: deque[tuple[str, str, bytes]] = deque()
        self.tamper: dict[str, FrameFilter] = {}
        self.now = 0.0
        self.delivered = 0

    def sender(self, name: str) -> Callable[[Hashable, bytes], None]:
        def send(peer: Hashable, frame: bytes) -> None:
            if name in self.tamper:
                frame = self.tamper[name](frame)
            self.queue.append((name, str(peer), frame))

        return send

    def closer(self, name: str) -> Callable[[Hashable, str], None]:
        def close(peer: Hashable, reason: str) -> None:
            link = frozenset((name, str(peer)))
            if link in self.links:
                self.links.discard(link)
                self.transfers[str(peer)].disconnected(name, self.now)

        return close

    def add(self, name: str, transfer: CheckpointTransfer) -> None:
        self.transfers[name] = transfer

    def connect(self, a: str, b: str) -> None:
        self.links.add(frozenset((a, b)))
        self.transfers[a].connected(b, self.now)
        self.transfers[b].connected(a, self.now)

    def disconnect(self, name: str) -> None:
        """``name`` vanishes (its process died): every link it had drops."""
        for link in [link for link in self.links if name in link]:
            self.links.discard(link)
            (other,) = link - {name}
            self.transfers[other].disconnected(name, self.now)

    def run(self, *, max_frames: int = 1_000_000, stop: Callable[[], bool] | None = None) -> None:
        while self.queue and self.delivered < max_frames:
            if stop is not None and stop():
                return
            src, dst, frame = self.queue.popleft()
            self.now += 0.001
            if frozenset((src, dst)) in self.links:
                self.delivered += 1
                self.transfers[dst].frame(src, frame, self.now)
