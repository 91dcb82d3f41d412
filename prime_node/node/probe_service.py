"""Serve ``/prime-node/probe/1`` (protocol/probe.py): a peer asks for our wall clock, or to download or
upload a few MiB of random bytes, so ``prime-node doctor`` can tell its user the clock skew and bandwidth
to the swarm.

Every node serves it, and anyone may ask, so: one probe per peer at a time, a request and byte budget per
peer per minute, a few transfers at once in all (``ProbeLimiter``), a deadline per probe, every frame
capped. A refused or malformed request gets a ``ProbeRefused`` frame, a ``ProbeRefusedError`` (a NodeError) in
the log, and a malformed one also costs the peer score.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import trio

from prime_node.errors import NodeError
from prime_node.node.context import NodeContext
from prime_node.p2p.interface import FramedStream
from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.probe import (
    DOWNLOAD,
    MALFORMED,
    PROBE_PROTOCOL,
    TIME,
    ChunkCounter,
    ProbeChunk,
    ProbeDone,
    ProbeLimiter,
    ProbeLimits,
    ProbeReady,
    ProbeRefused,
    ProbeRequest,
    ProbeTime,
    chunk_sizes,
)
from protocol.scoring import Offence

log = logging.getLogger(__name__)
PROBE_DEADLINE_S = 20.0
"""The longest one probe may hold a stream (4 MiB at ~200 KB/s)."""


class ProbeRefusedError(NodeError):
    """A probe we refused (or that the peer refused us): ``reason`` is protocol/probe.py's code."""


class ProbeService:
    """The node service (see the module doc); ``served`` and ``refused`` count probes by kind / reason."""

    def __init__(self, limits: ProbeLimits | None = None) -> None:
        self.limiter = ProbeLimiter(limits or ProbeLimits())
        self.served: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self._context: NodeContext | None = None

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._context = context
        context.host.set_stream_handler(PROBE_PROTOCOL, self.serve)
        context.add_status_section("probe", self.status)
        task_status.started()
        await trio.sleep_forever()

    def status(self) -> dict[str, Any]:
        return {"served": dict(self.served), "refused": dict(self.refused), "peers": len(self.limiter)}

    async def serve(self, stream: FramedStream) -> None:
        """One probe on one stream; never raises for anything the peer did."""
        context = self._context
        assert context is not None
        peer = stream.remote_peer_id
        with trio.move_on_after(PROBE_DEADLINE_S) as deadline:
            try:
                await self._serve(context, stream, peer)
            except (RemoteProtocolError, NodeError) as exc:
                if isinstance(exc, RemoteProtocolError) or exc.reason == "frame_too_large":
                    context.policy.offence(peer, Offence.MALFORMED, exc.reason)
                    await self._refuse(context, stream, ProbeRefused(MALFORMED), str(exc))
                else:  # the stream broke: the peer went away mid-probe
                    log.debug("probe from %s ended: %s", peer, exc)
        if deadline.cancelled_caught:
            self._count(self.refused, "probe_timeout")
            log.info("probe from %s took more than %.0f s; stream closed", peer, PROBE_DEADLINE_S)

    async def _serve(self, context: NodeContext, stream: FramedStream, peer: str) -> None:
        frame = await stream.receive_frame(ProbeRequest.MAX_BYTES)
        if frame is None:
            return
        request = decode(frame, ProbeRequest)
        refusal = self.limiter.admit(peer, request, context.clock.now())
        if refusal is not None:
            await self._refuse(context, stream, refusal, f"{request.kind} of {request.size} bytes")
            return
        try:
            if request.kind == TIME:
                await stream.send_frame(encode(ProbeTime(context.clock.wall_ms())))
            elif request.kind == DOWNLOAD:
                for size in chunk_sizes(request.size):
                    await stream.send_frame(encode(ProbeChunk(os.urandom(size))))
            else:
                await stream.send_frame(encode(ProbeReady()))
                counter = ChunkCounter(request.size)
                while not counter.done:
                    chunk = await stream.receive_frame(ProbeChunk.MAX_BYTES)
                    if chunk is None:
                        raise RemoteProtocolError("upload ended early", reason=MALFORMED)
                    counter.feed(decode(chunk, ProbeChunk))
                await stream.send_frame(encode(ProbeDone(counter.received)))
            self._count(self.served, request.kind)
        finally:
            self.limiter.finish(peer, request)

    async def _refuse(
        self, context: NodeContext, stream: FramedStream, refusal: ProbeRefused, what: str
    ) -> None:
        error = ProbeRefusedError(
            f"probe from {stream.remote_peer_id} refused: {what}", reason=refusal.reason
        )
        self._count(self.refused, error.reason)
        context.metrics.reject(error.reason)
        log.info("%s (%s)", error, error.reason)
        try:
            await stream.send_frame(encode(refusal))
        except NodeError:
            log.debug("could not tell %s its probe was refused", stream.remote_peer_id)

    @staticmethod
    def _count(counts: dict[str, int], key: str) -> None:
        if key in counts or len(counts) < 32:
            counts[key] = counts.get(key, 0) + 1
