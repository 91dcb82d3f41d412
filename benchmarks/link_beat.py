"""CPU per neighbour-link beat: a libp2p stream (Noise + yamux) against the data plane's authenticated
TCP channel, same process, same run.

Issue 16 part 2: an idle node's CPU goes to its neighbour links' beats (docs/benchmarks.md, *Idle
node*). Two endpoints in this process hold ``LINKS`` links to each other; on each link both sides send a
real beat frame (``NeighbourFrame`` BEAT, no records) ``RATE`` times per second and read the other's.
The process's CPU time over ``WINDOW`` seconds, minus the same endpoints idle over the same window,
divided by the beats received, is the CPU one beat costs its sender and its receiver together. The
transports alternate ``REPEATS`` times; the median of each counts (the machine is shared and noisy).

Prints one JSON line: ``cpu_ms_per_beat_libp2p``, ``cpu_ms_per_beat_channel`` and
``ratio_channel_to_libp2p``.

    .venv/bin/python benchmarks/link_beat.py
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from crypto.keys import WalletKey  # noqa: E402
from prime_node.dataplane.connect import open_channel, serve_channels  # noqa: E402
from prime_node.p2p.interface import FramedStream  # noqa: E402
from prime_node.p2p.libp2p_host import open_libp2p_host  # noqa: E402
from protocol.codec import encode  # noqa: E402
from protocol.overlay import FrameKind, NeighbourFrame  # noqa: E402

LINKS = int(os.environ.get("BENCH_LINKS", "8"))
RATE = float(os.environ.get("BENCH_RATE", "10"))
WINDOW = float(os.environ.get("BENCH_WINDOW", "10"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
PROTOCOL = "/prime-node/bench-beat/1"


class Link(Protocol):
    async def send_frame(self, data: bytes) -> None: ...


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _beat() -> bytes:
    return encode(NeighbourFrame(FrameKind.BEAT.value, int(time.time() * 1000), ()))


async def _beat_both_ways(pairs: list[tuple[Link, Link]], receive: Callable[[Any], Awaitable[Any]]) -> int:
    """Beat on every link, both ways, for WINDOW seconds; the number of beats received."""
    received = 0

    async def send_loop(link: Link) -> None:
        while True:
            await link.send_frame(_beat())
            await trio.sleep(1 / RATE)

    async def receive_loop(link: Link) -> None:
        nonlocal received
        while True:
            await receive(link)
            received += 1

    with trio.move_on_after(WINDOW):
        async with trio.open_nursery() as nursery:
            for a, b in pairs:
                for link in (a, b):
                    nursery.start_soon(send_loop, link)
                    nursery.start_soon(receive_loop, link)
    return received


async def _measure(pairs: list[tuple[Link, Link]], receive: Callable[[Any], Awaitable[Any]]) -> float:
    """CPU ms per beat received, net of the same endpoints idle over the same window."""
    start = _cpu()
    await trio.sleep(WINDOW)
    idle = _cpu() - start
    start = _cpu()
    beats = await _beat_both_ways(pairs, receive)
    busy = _cpu() - start
    return (busy - idle) * 1000 / max(beats, 1)


@asynccontextmanager
async def _libp2p_links() -> AsyncIterator[list[tuple[Link, Link]]]:
    inbound: trio.MemorySendChannel[FramedStream]
    inbound, arrived = trio.open_memory_channel[FramedStream](LINKS)
    parked = trio.Event()

    async def accept(stream: FramedStream) -> None:
        await inbound.send(stream)
        await parked.wait()  # the stream lives as long as its handler

    listen = "/ip4/127.0.0.1/tcp/0"
    async with (
        open_libp2p_host(WalletKey.generate(), listen=listen) as a,
        open_libp2p_host(WalletKey.generate(), listen=listen) as b,
    ):
        b.set_stream_handler(PROTOCOL, accept)
        await a.connect(b.listen_multiaddrs()[0])
        pairs: list[tuple[Link, Link]] = []
        for _ in range(LINKS):
            ours = await a.open_stream(b.peer_id, PROTOCOL)
            await ours.send_frame(b"open")  # the handler runs once the first bytes arrive
            theirs = await arrived.receive()
            await theirs.receive_frame()
            pairs.append((ours, theirs))
        yield pairs
        parked.set()


@asynccontextmanager
async def _channel_links() -> AsyncIterator[list[tuple[Link, Link]]]:
    listener, dialer = WalletKey.generate(), WalletKey.generate()
    inbound, arrived = trio.open_memory_channel[Any](LINKS)
    parked = trio.Event()

    async def accept(channel: Any) -> None:
        await inbound.send(channel)
        await parked.wait()

    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_channels, listener, accept)
        pairs: list[tuple[Link, Link]] = []
        for _ in range(LINKS):
            ours = await open_channel("127.0.0.1", port, dialer, expected_peer=listener.address)
            pairs.append((ours, await arrived.receive()))
        yield pairs
        parked.set()
        for ours, _ in pairs:
            await ours.aclose()  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()


async def _libp2p_once() -> float:
    async with _libp2p_links() as pairs:
        return await _measure(pairs, lambda link: link.receive_frame())


async def _channel_once() -> float:
    async with _channel_links() as pairs:
        return await _measure(pairs, lambda link: link.receive_frame())


async def main() -> dict[str, Any]:
    libp2p: list[float] = []
    channel: list[float] = []
    for _ in range(REPEATS):
        libp2p.append(await _libp2p_once())
        channel.append(await _channel_once())
    over_libp2p, over_channel = statistics.median(libp2p), statistics.median(channel)
    return {
        "benchmark": "link_beat",
        "links": LINKS,
        "beats_per_s_each_way": RATE,
        "window_s": WINDOW,
        "cpu_ms_per_beat_libp2p": round(over_libp2p, 3),
        "cpu_ms_per_beat_channel": round(over_channel, 3),
        "ratio_channel_to_libp2p": round(over_channel / over_libp2p, 3),
        "runs_libp2p": [round(v, 3) for v in libp2p],
        "runs_channel": [round(v, 3) for v in channel],
    }


if __name__ == "__main__":
    print(json.dumps(trio.run(main)))
