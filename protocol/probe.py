"""The probe exchange (``/prime-node/probe/1``): what ``prime-node doctor`` asks a peer to learn the clock
skew between them and the bandwidth of the path.

Every node serves it, so every request is from a stranger: sizes are capped (``MAX_PROBE_BYTES`` per
request, ``CHUNK_BYTES`` per frame), a peer runs one probe at a time, and its requests and bytes per
window are budgeted (``ProbeLimiter``). Sans-IO: the caller supplies ``now`` and does the I/O.

One stream per probe. The requester sends a ``ProbeRequest``; the server answers
- ``time``: one ``ProbeTime`` (its wall clock, ms);
- ``download``: ``ProbeChunk`` frames of random bytes adding up to ``size``;
- ``upload``: ``ProbeReady``, then the requester sends ``ProbeChunk`` frames adding up to ``size`` and the
  server answers ``ProbeDone``;
or, to any of them, ``ProbeRefused`` with a reason (and when to come back).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Final

from protocol.codec import IntRange, MaxLen, Message, message
from protocol.errors import InvariantError, RemoteProtocolError

PROBE_PROTOCOL: Final = "/prime-node/probe/1"
MAX_PROBE_BYTES: Final = 4 << 20
"""The most bytes one download or upload probe moves (enough to time a home link, too little to abuse)."""
CHUNK_BYTES: Final = 256 << 10
"""The most bytes one ``ProbeChunk`` frame carries."""
TIME: Final = "time"
DOWNLOAD: Final = "download"
UPLOAD: Final = "upload"
KINDS: Final = (TIME, DOWNLOAD, UPLOAD)
_WALL_MS = (0, (1 << 63) - 1)

# Refusal reasons (ProbeRefused.reason); each is also a NodeError reason on the requester's side.
BUSY: Final = "probe_busy"
RATE_LIMITED: Final = "probe_rate_limited"
OVERLOADED: Final = "probe_overloaded"
MALFORMED: Final = "probe_malformed"


@message("probe.request", max_bytes=128)
@dataclass(frozen=True)
class ProbeRequest(Message):
    kind: Annotated[str, MaxLen(16)]
    size: Annotated[int, IntRange(0, MAX_PROBE_BYTES)] = 0
    """Bytes to move (download, upload); 0 for ``time``."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvariantError(f"unknown probe kind {self.kind[:16]!r}", reason="bad_probe")
        if (self.kind == TIME) != (self.size == 0):
            raise InvariantError(
                "a time probe moves no bytes; a transfer probe moves some", reason="bad_probe"
            )


@message("probe.time", max_bytes=64)
@dataclass(frozen=True)
class ProbeTime(Message):
    wall_ms: Annotated[int, IntRange(*_WALL_MS)]
    """The server's wall clock (the one its signed envelopes carry) when it answered."""


@message("probe.ready", max_bytes=32)
@dataclass(frozen=True)
class ProbeReady(Message):
    """The server accepts an upload: send the chunks now."""


@message("probe.chunk", max_bytes=CHUNK_BYTES + 64)
@dataclass(frozen=True)
class ProbeChunk(Message):
    data: Annotated[bytes, MaxLen(CHUNK_BYTES)]


@message("probe.done", max_bytes=64)
@dataclass(frozen=True)
class ProbeDone(Message):
    received: Annotated[int, IntRange(0, MAX_PROBE_BYTES)]


@message("probe.refused", max_bytes=256)
@dataclass(frozen=True)
class ProbeRefused(Message):
    reason: Annotated[str, MaxLen(64)]
    retry_after_ms: Annotated[int, IntRange(0, 86_400_000)] = 0


def chunk_sizes(total: int) -> list[int]:
    """How ``total`` bytes are cut into chunks (all full but the last)."""
    if not 0 <= total <= MAX_PROBE_BYTES:
        raise InvariantError(f"probe size {total} outside [0, {MAX_PROBE_BYTES}]", reason="bad_probe")
    full, rest = divmod(total, CHUNK_BYTES)
    return [CHUNK_BYTES] * full + ([rest] if rest else [])


class ChunkCounter:
    """Counts the chunks of one transfer; a peer that sends an empty chunk or more than announced is
    refused (RemoteProtocolError), so a transfer is always exactly ``expected`` bytes."""

    def __init__(self, expected: int) -> None:
        if not 0 < expected <= MAX_PROBE_BYTES:
            raise InvariantError(f"probe size {expected} outside [1, {MAX_PROBE_BYTES}]", reason="bad_probe")
        self.expected = expected
        self.received = 0

    def feed(self, chunk: ProbeChunk) -> None:
        if not chunk.data:
            raise RemoteProtocolError("empty probe chunk", reason=MALFORMED)
        if self.received + len(chunk.data) > self.expected:
            raise RemoteProtocolError(
                f"probe sent {self.received + len(chunk.data)} bytes of {self.expected}", reason=MALFORMED
            )
        self.received += len(chunk.data)

    @property
    def done(self) -> bool:
        return self.received == self.expected


@dataclass(frozen=True)
class ProbeLimits:
    """What one node serves to probers."""

    max_bytes: int = MAX_PROBE_BYTES
    """Largest download or upload one request may ask for."""
    window_s: float = 60.0
    """The budget window below."""
    requests_per_window: int = 20
    """Probes one peer may run per window (a doctor run takes 5)."""
    bytes_per_window: int = 4 * MAX_PROBE_BYTES
    """Bytes one peer may move (both ways together) per window."""
    max_concurrent: int = 4
    """Transfer probes served at once over all peers (each holds a stream and some CPU)."""
    max_peers: int = 1024
    """Peers whose budgets are remembered; the least recently seen is forgotten first."""

    def __post_init__(self) -> None:
        if not (
            0 < self.max_bytes <= MAX_PROBE_BYTES
            and self.window_s > 0
            and min(self.requests_per_window, self.bytes_per_window, self.max_concurrent, self.max_peers) >= 1
        ):
            raise InvariantError("probe limits must be positive (max_bytes <= 4 MiB)", reason="bad_probe")


@dataclass
class _Budget:
    started: float
    requests: int = 0
    bytes: int = 0
    active: bool = False


@dataclass
class ProbeLimiter:
    """One probe at a time per peer, a request and byte budget per peer and window, a global cap on
    transfers in flight. ``admit`` returns a refusal, or None and the probe runs until ``finish``."""

    limits: ProbeLimits = field(default_factory=ProbeLimits)
    _peers: OrderedDict[str, _Budget] = field(default_factory=OrderedDict)
    _transfers: int = 0

    def admit(self, peer_id: str, request: ProbeRequest, now: float) -> ProbeRefused | None:
        budget = self._peers.get(peer_id)
        if budget is None or now - budget.started >= self.limits.window_s:
            active = budget is not None and budget.active
            budget = _Budget(started=now, active=active)
        self._peers[peer_id] = budget
        self._peers.move_to_end(peer_id)
        self._forget_beyond_capacity()
        retry_ms = max(0, int((budget.started + self.limits.window_s - now) * 1000))
        if budget.active:
            return ProbeRefused(BUSY, 1000)
        if request.size > self.limits.max_bytes:
            return ProbeRefused(RATE_LIMITED, 0)
        if budget.requests >= self.limits.requests_per_window:
            return ProbeRefused(RATE_LIMITED, retry_ms)
        if budget.bytes + request.size > self.limits.bytes_per_window:
            return ProbeRefused(RATE_LIMITED, retry_ms)
        if request.size and self._transfers >= self.limits.max_concurrent:
            return ProbeRefused(OVERLOADED, 1000)
        budget.requests += 1
        budget.bytes += request.size
        budget.active = True
        if request.size:
            self._transfers += 1
        return None

    def finish(self, peer_id: str, request: ProbeRequest) -> None:
        """The admitted probe of ``peer_id`` ended (however it ended)."""
        budget = self._peers.get(peer_id)
        if budget is not None:
            budget.active = False
        if request.size:
            self._transfers = max(0, self._transfers - 1)

    def _forget_beyond_capacity(self) -> None:
        # A peer with a probe in flight keeps its entry (its ``finish`` must find it); the others go oldest
        # first. At most ``max_concurrent`` transfers plus one time probe per peer can be active.
        for peer_id in list(self._peers):
            if len(self._peers) <= self.limits.max_peers:
                return
            if not self._peers[peer_id].active:
                del self._peers[peer_id]

    def __len__(self) -> int:
        return len(self._peers)


@dataclass(frozen=True)
class ClockSample:
    """One time probe seen from the requester: its wall clock when it sent and when the answer came."""

    sent_ms: int
    server_ms: int
    received_ms: int


@dataclass(frozen=True)
class ClockEstimate:
    skew_ms: int
    """How far the peer's clock is ahead of ours (negative: behind)."""
    rtt_ms: int
    """Round trip of the sample used; the skew is known to within half of it."""


def estimate_skew(samples: list[ClockSample]) -> ClockEstimate:
    """NTP's rule on the sample with the shortest round trip: the server read its clock halfway."""
    usable = [s for s in samples if s.received_ms >= s.sent_ms]
    if not usable:
        raise InvariantError("no clock sample with a non-negative round trip", reason="bad_probe")
    best = min(usable, key=lambda s: s.received_ms - s.sent_ms)
    midpoint = (best.sent_ms + best.received_ms) // 2
    return ClockEstimate(best.server_ms - midpoint, best.received_ms - best.sent_ms)
