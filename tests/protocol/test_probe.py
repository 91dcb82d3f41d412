"""The probe exchange's messages, chunking, per-peer limits and the clock estimate (protocol/probe.py)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.codec import WIRE_VERSION, decode, decode_any, encode
from protocol.errors import InvariantError, LocalProtocolError, RemoteProtocolError
from protocol.probe import (
    BUSY,
    CHUNK_BYTES,
    DOWNLOAD,
    KINDS,
    MAX_PROBE_BYTES,
    OVERLOADED,
    RATE_LIMITED,
    TIME,
    UPLOAD,
    ChunkCounter,
    ClockSample,
    ProbeChunk,
    ProbeDone,
    ProbeLimiter,
    ProbeLimits,
    ProbeReady,
    ProbeRefused,
    ProbeRequest,
    ProbeTime,
    chunk_sizes,
    estimate_skew,
)
from tests.strategies.probe import probe_requests

replies = st.one_of(
    st.builds(ProbeTime, st.integers(0, (1 << 63) - 1)),
    st.just(ProbeReady()),
    st.builds(ProbeChunk, st.binary(max_size=512)),
    st.builds(ProbeDone, st.integers(0, MAX_PROBE_BYTES)),
    st.builds(ProbeRefused, st.text(max_size=64), st.integers(0, 86_400_000)),
)


@given(st.one_of(probe_requests, replies))
def test_every_probe_message_round_trips(message: object) -> None:
    frame = encode(message)  # type: ignore[arg-type]
    assert decode_any(frame) == message
    assert len(frame) <= type(message).MAX_BYTES  # type: ignore[attr-defined]


@given(st.binary(max_size=300))
def test_random_bytes_parse_as_a_request_or_raise_remote_error(data: bytes) -> None:
    try:
        request = decode(data, ProbeRequest)
    except RemoteProtocolError:
        return
    assert request.kind in KINDS and 0 <= request.size <= MAX_PROBE_BYTES


@pytest.mark.parametrize(
    ("kind", "size"),
    [("time", 5), ("download", 0), ("upload", 0), ("shell", 1), ("download", MAX_PROBE_BYTES + 1)],
)
def test_a_request_that_breaks_the_rules_is_refused_on_the_wire(kind: str, size: int) -> None:
    frame = msgpack.packb([WIRE_VERSION, "probe.request", [kind, size]], use_bin_type=True)
    with pytest.raises(RemoteProtocolError):
        decode(frame, ProbeRequest)


def test_a_chunk_larger_than_the_cap_cannot_be_sent_or_received() -> None:
    with pytest.raises(LocalProtocolError):
        encode(ProbeChunk(b"x" * (CHUNK_BYTES + 1)))
    frame = msgpack.packb([WIRE_VERSION, "probe.chunk", [b"x" * (CHUNK_BYTES + 1)]], use_bin_type=True)
    with pytest.raises(RemoteProtocolError):
        decode(frame, ProbeChunk)


@given(st.integers(0, MAX_PROBE_BYTES))
def test_chunks_add_up_and_stay_under_the_cap(total: int) -> None:
    sizes = chunk_sizes(total)
    assert sum(sizes) == total
    assert all(0 < size <= CHUNK_BYTES for size in sizes)


def test_chunk_sizes_refuses_more_than_the_probe_cap() -> None:
    with pytest.raises(InvariantError):
        chunk_sizes(MAX_PROBE_BYTES + 1)


@given(st.integers(1, MAX_PROBE_BYTES), st.lists(st.integers(0, CHUNK_BYTES), max_size=40))
def test_a_counter_never_accepts_more_than_announced_or_an_empty_chunk(
    expected: int, sizes: list[int]
) -> None:
    counter = ChunkCounter(expected)
    for size in sizes:
        before = counter.received
        try:
            counter.feed(ProbeChunk(b"\0" * size))
        except RemoteProtocolError:
            assert size == 0 or before + size > expected
            assert counter.received == before
        assert counter.received <= expected
    assert counter.done == (counter.received == expected)


def test_one_probe_per_peer_at_a_time() -> None:
    limiter = ProbeLimiter(ProbeLimits())
    request = ProbeRequest(DOWNLOAD, 1000)
    assert limiter.admit("a", request, 0.0) is None
    refused = limiter.admit("a", ProbeRequest(TIME), 0.1)
    assert refused is not None and refused.reason == BUSY
    assert limiter.admit("b", ProbeRequest(TIME), 0.1) is None  # another peer is not held up
    limiter.finish("a", request)
    assert limiter.admit("a", ProbeRequest(TIME), 0.2) is None


def test_requests_and_bytes_per_window_are_budgeted_then_refilled() -> None:
    limits = ProbeLimits(requests_per_window=3, bytes_per_window=3 << 20, window_s=60)
    limiter = ProbeLimiter(limits)
    big = ProbeRequest(UPLOAD, 2 << 20)
    assert limiter.admit("a", big, 0.0) is None
    limiter.finish("a", big)
    refused = limiter.admit("a", big, 1.0)  # 4 MiB > 3 MiB per window
    assert refused is not None and refused.reason == RATE_LIMITED and 0 < refused.retry_after_ms <= 60_000
    for now in (2.0, 3.0):
        assert limiter.admit("a", ProbeRequest(TIME), now) is None
        limiter.finish("a", ProbeRequest(TIME))
    refused = limiter.admit("a", ProbeRequest(TIME), 4.0)  # the fourth request in the window
    assert refused is not None and refused.reason == RATE_LIMITED
    assert limiter.admit("a", big, 61.0) is None  # a new window


def test_transfers_in_flight_are_capped_over_all_peers() -> None:
    limiter = ProbeLimiter(ProbeLimits(max_concurrent=2))
    request = ProbeRequest(DOWNLOAD, 10)
    assert limiter.admit("a", request, 0.0) is None
    assert limiter.admit("b", request, 0.0) is None
    refused = limiter.admit("c", request, 0.0)
    assert refused is not None and refused.reason == OVERLOADED
    assert limiter.admit("c", ProbeRequest(TIME), 0.0) is None  # a time probe costs nothing
    limiter.finish("a", request)
    limiter.finish("c", ProbeRequest(TIME))
    assert limiter.admit("c", request, 0.0) is None


@given(st.lists(st.tuples(st.integers(0, 5000), st.booleans()), max_size=300))
def test_remembered_peers_stay_bounded(events: list[tuple[int, bool]]) -> None:
    limiter = ProbeLimiter(ProbeLimits(max_peers=16))
    active: set[str] = set()
    for now, (peer, finish) in enumerate(events):
        name = f"p{peer}"
        if finish and name in active:
            limiter.finish(name, ProbeRequest(TIME))
            active.discard(name)
        elif limiter.admit(name, ProbeRequest(TIME), float(now)) is None:
            active.add(name)
        assert len(limiter) <= 16 + len(active)


@given(
    st.integers(-(10**8), 10**8),
    st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500)), min_size=1, max_size=5),
)
def test_the_skew_estimate_is_within_half_the_round_trip(offset: int, delays: list[tuple[int, int]]) -> None:
    samples = []
    start = 1_700_000_000_000
    for out, back in delays:  # the server reads its clock after ``out`` ms; the answer takes ``back`` ms
        samples.append(ClockSample(start, start + out + offset, start + out + back))
        start += 1000
    estimate = estimate_skew(samples)
    assert estimate.rtt_ms == min(out + back for out, back in delays)
    assert abs(estimate.skew_ms - offset) <= estimate.rtt_ms / 2 + 1


def test_no_usable_clock_sample_is_a_local_error() -> None:
    with pytest.raises(InvariantError):
        estimate_skew([ClockSample(10, 5, 9)])
