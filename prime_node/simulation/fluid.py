"""A discrete-event clock with bandwidth modelled as fluid flows.

Instead of packets, a transfer is a flow of ``size`` bytes with a rate. Each upload link is split
equally among the flows leaving it, which caps each flow at ``upload[src] / flows leaving src``; each
download link is then water-filled among the flows entering it (flows capped lower by their uploader
take only that, the rest share what is left equally), as TCP's max-min sharing roughly does. Rates
change only when a flow starts or ends, so the simulator recomputes the download links of the flows
sharing that flow's uploader and downloader and reschedules only flows whose rate changed. (Capacity an
uploader cannot push into a saturated downloader is not given to its other flows: the model errs on the
slow side.)

Events are ``(time, seq, callback, args)`` in a heap; a flow's completion event carries the flow's
version, so a rescheduled flow's stale events are skipped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class Flow:
    __slots__ = ("args", "dst", "on_done", "rate", "remaining", "src", "started", "updated", "version")

    def __init__(self, src: int, dst: int, size: float, on_done: Callable[..., None], args: tuple[Any, ...]):
        self.src = src
        self.dst = dst
        self.remaining = size
        self.rate = 0.0
        self.updated = 0.0
        self.started = 0.0
        self.version = 0
        self.on_done = on_done
        self.args = args


class FluidNetwork:
    """The event loop and the flows over every node's access links."""

    def __init__(self, uploads: list[float], downloads: list[float]) -> None:
        self.now = 0.0
        self.uploads = uploads
        self.downloads = downloads
        # Insertion-ordered (dicts, not sets of objects hashed by address), so runs are reproducible.
        self.leaving: list[dict[Flow, None]] = [{} for _ in uploads]
        self.entering: list[dict[Flow, None]] = [{} for _ in uploads]
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.events = 0
        self.bytes_moved = 0.0

    # --- events ----------------------------------------------------------------------------------------

    def at(self, time: float, callback: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, callback, args))

    def run(self, *, until: float = float("inf"), stop: Callable[[], bool] | None = None) -> None:
        heap = self._heap
        while heap:
            time, _, callback, args = heapq.heappop(heap)
            if time > until:
                heapq.heappush(heap, (time, 0, callback, args))
                self.now = until
                return
            self.now = time
            self.events += 1
            callback(*args)
            if stop is not None and stop():
                return

    # --- flows -----------------------------------------------------------------------------------------

    def start_flow(self, src: int, dst: int, size: float, on_done: Callable[..., None], *args: Any) -> Flow:
        flow = Flow(src, dst, size, on_done, args)
        flow.updated = flow.started = self.now
        self.leaving[src][flow] = None
        self.entering[dst][flow] = None
        self._rebalance(src, dst, flow)
        return flow

    def stop_flow(self, flow: Flow) -> None:
        """Abort a flow (the bytes sent so far are wasted)."""
        if flow not in self.leaving[flow.src]:
            return
        self._advance(flow)
        self._remove(flow)

    def _remove(self, flow: Flow) -> None:
        flow.version += 1
        self.leaving[flow.src].pop(flow, None)
        self.entering[flow.dst].pop(flow, None)
        self._rebalance(flow.src, flow.dst, None)

    def _advance(self, flow: Flow) -> None:
        sent = flow.rate * (self.now - flow.updated)
        flow.remaining -= sent
        self.bytes_moved += sent
        flow.updated = self.now

    def _rebalance(self, src: int, dst: int, new: Flow | None) -> None:
        receivers = {dst}
        receivers.update(flow.dst for flow in self.leaving[src])
        for receiver in receivers:
            self._water_fill(receiver, new)

    def _water_fill(self, dst: int, new: Flow | None) -> None:
        uploads, leaving = self.uploads, self.leaving
        capped = [(uploads[f.src] / len(leaving[f.src]), f) for f in self.entering[dst]]
        left = self.downloads[dst]
        if sum(cap for cap, _ in capped) > left:  # the download link is the bottleneck: share it
            capped.sort(key=_first)
            count = len(capped)
            for i, (cap, flow) in enumerate(capped):
                share = min(cap, left / (count - i))
                left -= share
                capped[i] = (share, flow)
        for rate, flow in capped:
            if flow is not new and rate == flow.rate:
                continue
            self._advance(flow)
            flow.rate = rate
            flow.version += 1
            self.at(self.now + max(flow.remaining, 0.0) / rate, self._flow_due, flow, flow.version)

    def _flow_due(self, flow: Flow, version: int) -> None:
        if version != flow.version:
            return
        self._advance(flow)
        self._remove(flow)
        flow.on_done(*flow.args)


def _first(item: tuple[float, Flow]) -> float:
    return item[0]
