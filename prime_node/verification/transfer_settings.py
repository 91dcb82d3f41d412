"""The bounds of one node's batch transfer: what it holds and serves (batch_serving.py) and how it fetches
(batch_transfer.py), in one settings record the services share.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferSettings:
    """Bounds of one node's batch transfer; the defaults suit a networked run."""

    hold_bytes: int = 256 << 20
    """Frames kept to serve (produced or fetched), all together; the oldest go first (the newest is
    always kept)."""
    max_fetches: int = 4
    """Attempts running at once (a fetch waiting for a holder holds none), granted round-robin across
    the batches' workers."""
    per_peer_fetches: int = 2
    """Downloads at once from one holder."""
    max_uploads: int = 16
    """Batches being served at once; beyond it requests are answered ``busy``."""
    per_peer_uploads: int = 2
    """Batches served at once to one peer; beyond it that peer is answered ``busy``."""
    reply_timeout_s: float = 10.0
    """Dial, handshake, request and the holder's reply, whatever the announced size."""
    chunk_grace_s: float = 2.0
    """Fixed part of the deadline of each ``CHUNK_BYTES`` of a body (see ``min_rate``)."""
    min_rate: float = 1 << 20
    """Byte-rate floor of a body: each next ``CHUNK_BYTES`` (or what remains) must arrive within
    ``chunk_grace_s + CHUNK_BYTES / min_rate`` (6 s at 1 MiB/s), however big the batch."""
    give_up_s: float = 30.0
    """How long a fetch waits for a holder to appear once every known one failed (not when the offering
    worker itself failed and no one else holds the batch)."""
    holder_backoff_s: float = 5.0
    """How long a holder that timed out, trickled or refused the connection is not dialled again; it
    doubles with each failure in a row, up to ``max_holder_backoff_s``, and a delivery resets it."""
    max_holder_backoff_s: float = 300.0
    max_banned: int = 4096
    """Peers remembered as banned from this data plane (the oldest forgotten first)."""
    request_timeout_s: float = 10.0
    """How long a served channel may take to send its request."""
    relayed_fallback: bool = False
    """Whether batches may move over a libp2p stream on a *relayed* connection (a relay's circuits are
    capped in bytes and carry the peers' control traffic: prime_node/dataplane/libp2p_stream.py)."""

    def __post_init__(self) -> None:
        counts = (self.max_fetches, self.per_peer_fetches, self.max_uploads, self.per_peer_uploads)
        times = (self.reply_timeout_s, self.chunk_grace_s, self.min_rate, self.max_banned)
        if min(counts) < 1 or self.hold_bytes < 1 or min(times) <= 0:
            raise ValueError("transfer bounds must be positive")
        if not 0 <= self.holder_backoff_s <= self.max_holder_backoff_s or self.give_up_s < 0:
            raise ValueError("backoffs and give_up_s must be non-negative, the first at most the cap")
