"""The requesting side of ``/prime-node/probe/1`` (protocol/probe.py): ask a peer its clock, time a
download and an upload. A refusal or a wrong answer is a NodeError with the reason; every call is bounded
by the caller's timeout (the stream's frames are capped by the codec)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import trio

from prime_node.errors import NodeError
from prime_node.node.probe_service import ProbeRefusedError
from prime_node.p2p.interface import FramedStream, P2PHost
from protocol.codec import Message, decode, decode_any, encode
from protocol.errors import RemoteProtocolError
from protocol.probe import (
    DOWNLOAD,
    PROBE_PROTOCOL,
    TIME,
    UPLOAD,
    ChunkCounter,
    ClockEstimate,
    ClockSample,
    ProbeChunk,
    ProbeDone,
    ProbeReady,
    ProbeRefused,
    ProbeRequest,
    ProbeTime,
    chunk_sizes,
    estimate_skew,
)

_REPLY_CAP = max(ProbeTime.MAX_BYTES, ProbeReady.MAX_BYTES, ProbeDone.MAX_BYTES, ProbeRefused.MAX_BYTES)


@dataclass(frozen=True)
class Transfer:
    bytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-6)


async def _reply(stream: FramedStream, expected: type[Message], cap: int = _REPLY_CAP) -> Message:
    frame = await stream.receive_frame(cap)
    if frame is None:
        raise NodeError("the peer closed the probe stream without answering", reason="probe_no_answer")
    try:
        message = decode_any(frame, max_bytes=cap)
    except RemoteProtocolError as exc:
        raise NodeError(f"the peer's probe answer is malformed: {exc}", reason="probe_bad_answer") from exc
    if isinstance(message, ProbeRefused):
        raise ProbeRefusedError(f"the peer refused the probe ({message.reason})", reason=message.reason)
    if not isinstance(message, expected):
        raise NodeError(f"the peer answered {message.TYPE}, not {expected.TYPE}", reason="probe_bad_answer")
    return message


async def _open(host: P2PHost, peer_id: str, request: ProbeRequest) -> FramedStream:
    stream = await host.open_stream(peer_id, PROBE_PROTOCOL)
    await stream.send_frame(encode(request))
    return stream


async def probe_clock(
    host: P2PHost, peer_id: str, wall_ms: Callable[[], int], rounds: int = 3
) -> ClockEstimate:
    """The peer's clock against ``wall_ms`` (ours), from the quickest of ``rounds`` asks."""
    samples = []
    for _ in range(rounds):
        sent = wall_ms()
        stream = await _open(host, peer_id, ProbeRequest(TIME))
        try:
            answer = await _reply(stream, ProbeTime)
        finally:
            await stream.close()
        assert isinstance(answer, ProbeTime)
        samples.append(ClockSample(sent, answer.wall_ms, wall_ms()))
    return estimate_skew(samples)


async def probe_download(host: P2PHost, peer_id: str, size: int) -> Transfer:
    """Time ``size`` random bytes from the peer (from the request to the last byte)."""
    started = trio.current_time()
    stream = await _open(host, peer_id, ProbeRequest(DOWNLOAD, size))
    try:
        counter = ChunkCounter(size)
        while not counter.done:
            frame = await stream.receive_frame(ProbeChunk.MAX_BYTES)
            if frame is None:
                raise NodeError(
                    f"download probe ended after {counter.received} bytes", reason="probe_no_answer"
                )
            try:
                message = decode_any(frame, max_bytes=ProbeChunk.MAX_BYTES)
                if isinstance(message, ProbeRefused):
                    raise ProbeRefusedError(
                        f"the peer refused the probe ({message.reason})", reason=message.reason
                    )
                counter.feed(decode(frame, ProbeChunk))
            except RemoteProtocolError as exc:
                raise NodeError(f"bad download probe data: {exc}", reason="probe_bad_answer") from exc
    finally:
        await stream.close()
    return Transfer(size, trio.current_time() - started)


async def probe_upload(host: P2PHost, peer_id: str, size: int) -> Transfer:
    """Time ``size`` random bytes to the peer (from its go-ahead to its receipt)."""
    stream = await _open(host, peer_id, ProbeRequest(UPLOAD, size))
    try:
        await _reply(stream, ProbeReady)
        started = trio.current_time()
        for chunk in chunk_sizes(size):
            await stream.send_frame(encode(ProbeChunk(os.urandom(chunk))))
        done = await _reply(stream, ProbeDone)
        assert isinstance(done, ProbeDone)
        if done.received != size:
            raise NodeError(f"the peer counted {done.received} of {size} bytes", reason="probe_bad_answer")
        return Transfer(size, trio.current_time() - started)
    finally:
        await stream.close()
