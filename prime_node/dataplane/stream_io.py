"""Byte I/O under an authenticated channel, with as few system calls and scheduler passes per byte as the
stream allows.

On a TCP socket (``trio.SocketStream``) it reads and writes the socket's descriptor directly with
``readv``/``writev``: a body's tail, its tag and the frames after it arrive in one call, and any number of
queued frames (header ‖ body ‖ tag each) leave in one call, straight from their buffers. A read that has
to wait sets ``SO_RCVLOWAT`` to the bytes the channel knows are coming (the rest of a frame), so the
kernel wakes the reader once per ``LOWAT_CAP`` bytes instead of once per packet: on a shaped link that
trickles into many sockets at once this was most of a receiver's CPU. A waiting read still looks at the
socket every ``poll`` seconds, so bytes that trickle in below the low-water mark count as progress for
the channel's deadlines. Trio's socket methods yield to the scheduler twice per call; here a call that
did not have to wait yields once (fairness: a peer that keeps the socket full cannot starve other tasks).

Any other stream (in-memory streams in tests) goes through ``receive_some``/``send_all``.

The descriptor is looked up before every call: once the stream is closed it reads as -1 (a closed
descriptor number may already belong to another connection) and the call fails ``ClosedResourceError``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence

import trio

Buffer = bytes | bytearray | memoryview

LOWAT_CAP = 512 << 10
"""At most this many bytes must be waiting before the kernel wakes a reader inside a frame body."""
IOV_BATCH = 512
"""Buffers per ``writev`` (Linux accepts 1,024)."""
SEND_SLICE = 256 << 10
"""Over a stream other than a TCP socket, bytes are sent in slices this large, each a sign of progress."""


class StreamIO:
    """Reads into caller's buffers and writes buffer lists; see the module doc. ``poll``: the longest a
    read waits below its low-water mark before it looks for bytes anyway."""

    def __init__(self, stream: trio.abc.Stream, *, poll: float) -> None:
        self.stream = stream
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._poll = poll
        self._lowat = 1

    async def read(self, views: list[memoryview], expect: int) -> int:
        """Bytes read into ``views`` (filled in order); 0 at end of stream. ``expect``: bytes the peer must
        still send before it may pause (the wait's low-water mark); 1 when it may pause at any point."""
        if self._socket is None:
            chunk = await self.stream.receive_some(len(views[0]))
            views[0][: len(chunk)] = chunk
            return len(chunk)
        waited = False
        while True:
            try:
                count = os.readv(self._descriptor(), views)
            except BlockingIOError:
                await self._wait_readable(min(max(expect, 1), LOWAT_CAP))
                waited = True
                continue
            if not waited:
                await trio.lowlevel.checkpoint()
            return count

    async def write(self, parts: Sequence[Buffer], moved: Callable[[], None]) -> None:
        """Send ``parts`` in order; ``moved()`` whenever bytes leave."""
        if self._socket is None:
            await self._send_slices(parts, moved)
            return
        index, offset, waited = 0, 0, False
        while index < len(parts):
            batch = list(parts[index : index + IOV_BATCH])
            if offset:
                batch[0] = memoryview(batch[0])[offset:]
            try:
                sent = os.writev(self._descriptor(), batch)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self._descriptor())
                waited = True
                continue
            moved()
            sent += offset
            while index < len(parts) and sent >= len(parts[index]):
                sent -= len(parts[index])
                index += 1
            offset = sent
        if not waited:
            await trio.lowlevel.checkpoint()

    async def _send_slices(self, parts: Sequence[Buffer], moved: Callable[[], None]) -> None:
        if sum(len(part) for part in parts) <= SEND_SLICE:
            await self.stream.send_all(b"".join(parts))
            moved()
            return
        for part in parts:
            view = memoryview(part)
            for start in range(0, len(view), SEND_SLICE):
                await self.stream.send_all(view[start : start + SEND_SLICE])
                moved()

    async def _wait_readable(self, lowat: int) -> None:
        assert self._socket is not None
        if lowat != self._lowat:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self._lowat = lowat
        if lowat == 1:
            await trio.lowlevel.wait_readable(self._descriptor())
            return
        with trio.move_on_after(self._poll):
            await trio.lowlevel.wait_readable(self._descriptor())

    def _descriptor(self) -> int:
        assert self._socket is not None
        descriptor = self._socket.fileno()
        if descriptor < 0:
            raise trio.ClosedResourceError("the stream is closed")
        return descriptor
