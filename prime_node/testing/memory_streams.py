"""In-memory streams for the data plane: channels, DataPlanes and whole checkpoint transfers run in one
process, deterministic, under trio's ``autojump_clock``.

``memory_pipe_pair`` is a connected pair of ``trio.abc.HalfCloseableStream`` with a bounded buffer in each
direction, like a TCP connection's windows: ``send_all`` returns once its bytes fit in the buffer and
blocks while the peer is not reading, so a peer that stops reading pushes back as it would on TCP. (trio's
``memory_stream_pair`` never pushes back; its ``lockstep_stream_pair`` has no buffer at all, so a sender
that writes a frame before its peer reads one deadlocks where TCP would not.)

A ``MemoryStreamNetwork`` is a ``StreamTransport`` (prime_node/dataplane/streams.py) that maps ``(host,
port)`` to a listener. Dialing an address nobody listens on is refused with ``ConnectionRefusedError`` and
listening on a taken one fails with ``OSError(EADDRINUSE)``, as with sockets, so the data plane's error
paths behave as on TCP.
"""

from __future__ import annotations

import errno
import itertools
import operator
from collections.abc import Callable

import trio

from prime_node.dataplane.streams import StreamListener

StreamPair = Callable[[], tuple[trio.abc.Stream, trio.abc.Stream]]
DEFAULT_CAPACITY = 256 << 10
DEFAULT_BACKLOG = 64
FIRST_PORT = 40_000


class _Pipe:
    """One direction of a connection: the bytes in flight, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.data = bytearray()
        self.eof = False  # the sender closed or sent EOF: nothing more will come
        self.reader_gone = False  # the receiver closed: whatever is sent is lost
        self.changed = trio.lowlevel.ParkingLot()

    def notify(self) -> None:
        self.changed.unpark_all()


class MemoryPipeStream(trio.abc.HalfCloseableStream):
    """One end of ``memory_pipe_pair``: writes into ``outgoing``, reads from ``incoming``."""

    def __init__(self, outgoing: _Pipe, incoming: _Pipe) -> None:
        self._out = outgoing
        self._in = incoming
        self._closed = False
        self._sending = False
        self._receiving = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._claim_send()
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            view = memoryview(data).cast("B")
            self._check_can_send()
            while view:
                room = self._out.capacity - len(self._out.data)
                if room > 0:
                    self._out.data += view[:room]
                    view = view[room:]
                    self._out.notify()
                else:
                    await self._out.changed.park()
                self._check_can_send()
        finally:
            self._sending = False
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        self._claim_send()
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            self._check_can_send()
            while len(self._out.data) >= self._out.capacity:
                await self._out.changed.park()
                self._check_can_send()
        finally:
            self._sending = False
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def send_eof(self) -> None:
        self._claim_send()
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            if self._closed:
                raise trio.ClosedResourceError("this stream is closed")
            self._out.eof = True
            self._out.notify()
        finally:
            self._sending = False
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError("max_bytes must be at least 1")
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving")
        self._receiving = True
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            while not self._in.data and not self._in.eof and not self._closed:
                await self._in.changed.park()
            if self._closed:
                raise trio.ClosedResourceError("this stream is closed")
            count = len(self._in.data) if max_bytes is None else min(max_bytes, len(self._in.data))
            chunk = bytes(self._in.data[:count])
            del self._in.data[:count]
            self._in.notify()
        finally:
            self._receiving = False
        await trio.lowlevel.cancel_shielded_checkpoint()
        return chunk

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._out.eof = True
            self._out.notify()
            self._in.reader_gone = True
            self._in.data.clear()
            self._in.notify()
        await trio.lowlevel.checkpoint()

    def _claim_send(self) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is already sending")
        self._sending = True

    def _check_can_send(self) -> None:
        if self._closed or self._out.eof:
            raise trio.ClosedResourceError("this stream is closed for sending")
        if self._out.reader_gone:
            raise trio.BrokenResourceError("the peer closed the connection")


def memory_pipe_pair(capacity: int = DEFAULT_CAPACITY) -> tuple[MemoryPipeStream, MemoryPipeStream]:
    """Two connected streams, each direction buffering at most ``capacity`` bytes (see the module doc)."""
    if capacity < 1:
        raise ValueError("capacity must be at least 1 byte")
    left_to_right, right_to_left = _Pipe(capacity), _Pipe(capacity)
    return MemoryPipeStream(left_to_right, right_to_left), MemoryPipeStream(right_to_left, left_to_right)


class MemoryListener(trio.abc.Listener[trio.abc.Stream]):
    """Incoming streams for one ``(host, port)``; closing it frees the address and refuses new dials."""

    def __init__(self, network: MemoryStreamNetwork, address: tuple[str, int], backlog: int) -> None:
        self.network = network
        self.address = address
        self._incoming, self._accepted = trio.open_memory_channel[trio.abc.Stream](backlog)

    def offer(self, stream: trio.abc.Stream) -> bool:
        """Queue a dialed stream for ``accept``; False when the backlog is full or the listener closed."""
        try:
            self._incoming.send_nowait(stream)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    async def accept(self) -> trio.abc.Stream:
        try:
            return await self._accepted.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError) as exc:
            raise trio.ClosedResourceError("the listener is closed") from exc

    async def aclose(self) -> None:
        if self.network.listeners.get(self.address) is self:
            del self.network.listeners[self.address]
        self._incoming.close()
        pending = []
        while True:
            try:
                pending.append(self._accepted.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        self._accepted.close()
        for stream in pending:  # dialed but never accepted: the dialer sees the connection end
            await trio.aclose_forcefully(stream)
        await trio.lowlevel.checkpoint()


class MemoryStreamNetwork:
    """Addresses in one process (see the module doc). Pass it as the ``transport`` of every peer."""

    def __init__(
        self,
        *,
        stream_pair: StreamPair = memory_pipe_pair,
        backlog: int = DEFAULT_BACKLOG,
    ) -> None:
        self.stream_pair = stream_pair
        self.backlog = backlog
        self.listeners: dict[tuple[str, int], MemoryListener] = {}
        self.dials = 0
        self._ports = itertools.count(FIRST_PORT)

    async def open_listeners(self, host: str, port: int) -> tuple[list[StreamListener], int]:
        await trio.lowlevel.checkpoint()
        if port == 0:
            port = next(p for p in self._ports if (host, p) not in self.listeners)
        if (host, port) in self.listeners:
            raise OSError(errno.EADDRINUSE, f"{host}:{port} is already in use")
        listener = MemoryListener(self, (host, port), self.backlog)
        self.listeners[(host, port)] = listener
        return [listener], port

    async def open_stream(self, host: str, port: int) -> trio.abc.Stream:
        await trio.lowlevel.checkpoint()
        self.dials += 1
        listener = self.listeners.get((host, port))
        if listener is None:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"nobody listens on {host}:{port}")
        ours, theirs = self.stream_pair()
        if not listener.offer(theirs):
            await trio.aclose_forcefully(ours)
            await trio.aclose_forcefully(theirs)
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"{host}:{port} is not accepting connections")
        return ours
