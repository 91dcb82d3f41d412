"""An in-memory transport for CheckpointTransfer: frames queue in order and are delivered one at a time,
so several transfers (an origin, fetchers with real PieceStores on disk, a misbehaving peer) can move a
real checkpoint between them in a test without a network.

A digested frame (a piece) is delivered as the receiving data-plane channel would deliver it: with the
digest of the bytes that arrived, never the sender's; if the sender named another digest, the channel's
MAC check would fail and close the link, and so does this transport."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

from crypto.digests import blake3
from prime_node.swarm.transfer import CheckpointTransfer
from protocol.dataplane import DigestedFrame, Frame

FrameFilter = Callable[[Frame], Frame]


class LoopbackSwarm:
    def __init__(self) -> None:
        self.transfers: dict[str, CheckpointTransfer] = {}
        self.links: set[frozenset[str]] = set()
        self.queue: deque[tuple[str, str, Frame]] = deque()
        self.tamper: dict[str, FrameFilter] = {}
        self.now = 0.0
        self.delivered = 0

    def sender(self, name: str) -> Callable[[Hashable, Frame], None]:
        def send(peer: Hashable, frame: Frame) -> None:
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
            if frozenset((src, dst)) not in self.links:
                continue
            if isinstance(frame, DigestedFrame):
                digest = blake3(frame.bulk)
                if frame.digest is not None and frame.digest != digest:  # the channel's MAC would fail
                    self.closer(src)(dst, "bad_mac")
                    continue
                frame = DigestedFrame(frame.head, frame.bulk, digest)
            self.delivered += 1
            self.transfers[dst].frame(src, frame, self.now)
