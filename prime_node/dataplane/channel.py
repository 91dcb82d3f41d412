"""The trio side of the data plane: MAC'd frames (protocol/dataplane.py) over a byte stream (a TCP socket,
or an in-memory stream in tests: prime_node/dataplane/streams.py) whose peer the handshake named
(connect.py opens channels).

An ``AuthenticatedChannel`` knows the wallet address of its peer and offers ``send_frame(bytes)`` /
``receive_frame() -> bytes``: exactly what a swarm transport needs (CheckpointTransfer's ``send`` and
``frame`` callbacks). Every failure (bad MAC, oversized or truncated frame, failed handshake, lost
connection, a frame that stalls, memory refused) is a ``ChannelError`` with a ``reason``, logged once,
and the stream is closed. A hostile peer must not cost more than it sends: a body is received into
chunks allocated as its bytes arrive (on TCP with ``recv_into``, no copy), each reserved from the node's
``MemoryBudget`` (budget.py), and a frame once begun must keep moving (``FrameDeadlines``). Every timeout
is trio's, so tests run under ``autojump_clock``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import trio

from crypto.keys import Address
from prime_node.dataplane.budget import MemoryBudget
from prime_node.dataplane.stream_io import StreamIO
from prime_node.errors import NodeError
from protocol.dataplane import (
    FRAME_HEADER,
    HEAD_LENGTH,
    TAG_SIZE,
    DigestedCheck,
    DigestedFrame,
    Frame,
    FrameCheck,
    FrameDeadlines,
    FrameOpener,
    FrameSealer,
    is_digested,
)
from protocol.dataplane_handshake import (
    SessionKeys,
)
from protocol.errors import ProtocolError, RemoteProtocolError

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = "swarm"
HANDSHAKE_TIMEOUT = 10.0
DEFAULT_DEADLINES = FrameDeadlines()
FIRST_CHUNK = 256 << 10
"""The first receive buffer of a large body; later ones grow with what has arrived (``_receive_body``)."""
CHUNK_GROWTH = 4
"""Each later chunk brings what is allocated to this many times what has arrived: few enough chunks (three
for a 4 MiB frame) that the extra reads cost no measurable throughput, at most 4× what a peer sent."""
READ_BUFFER = 64 << 10
"""Each channel's fixed read buffer: headers, tags and small frames are cut out of it, many per read."""
SMALL_FRAME = 32 << 10
"""Bodies up to this size are received whole into the read buffer; larger ones into their own chunks."""
POLLS_PER_IDLE = 20
"""A read waiting for more than one byte (``SO_RCVLOWAT``) looks at the socket every ``idle / 20`` s, so
bytes trickling in under the low-water mark still count for the frame deadlines."""


class ChannelError(NodeError):
    """The channel failed: handshake refused, integrity lost, or the connection dropped. It is closed."""


class AuthenticatedChannel:
    """A stream whose peer proved its wallet address. Frames in each direction are MAC'd and
    numbered; one sender and one receiver may run at once (each side has its own lock).

    Receive buffers draw on ``account`` (this channel's share of the node's ``MemoryBudget``) and grow
    with the bytes that arrive; a frame in either direction must keep to ``deadlines``. When the budget
    evicts the channel, whatever it is doing stops with ChannelError ``memory_budget``.

    Bytes arrive through one fixed read buffer of ``READ_BUFFER`` bytes: a frame of at most
    ``SMALL_FRAME`` bytes is cut out of it (many control frames per read), a larger body is read straight
    into its own chunks (see ``_receive_body``).
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        keys: SessionKeys,
        *,
        max_frame: int,
        deadlines: FrameDeadlines = DEFAULT_DEADLINES,
        budget: MemoryBudget | None = None,
    ) -> None:
        self._stream = stream
        self.stream = stream
        """What the channel runs over (the data plane tells TCP from a libp2p fallback stream by it)."""
        self._io = StreamIO(stream, poll=deadlines.idle / POLLS_PER_IDLE)
        self.remote: Address = keys.remote
        self._sealer = FrameSealer(keys.send_key, keys.send_direction, max_frame=max_frame)
        self._opener = FrameOpener(keys.receive_key, keys.receive_direction, max_frame=max_frame)
        self._deadlines = deadlines
        self.account = (budget or MemoryBudget()).account(str(keys.remote), self._evict)
        self._send_lock = trio.Lock()
        self._receive_lock = trio.Lock()
        self._scopes: set[trio.CancelScope] = set()
        self._buffer = bytearray(READ_BUFFER)
        self._start = 0  # unread bytes are self._buffer[self._start : self._end]
        self._end = 0
        self.closed = False
        self.evicted = False
        self.on_evict: Callable[[], None] | None = None
        """Called (synchronously) when the budget evicts this channel, after its operations are cancelled:
        its owner should let go of whatever else it holds for the channel."""

    async def send_frame(self, data: bytes) -> None:
        """Send one frame (≤ the cap). ChannelError if the connection is gone, or if the peer does not
        take the frame's bytes within its deadlines (``frame_stalled``, ``frame_too_slow``)."""
        await self.send_frames((data,))

    async def send_frames(self, frames: Sequence[Frame]) -> None:
        """Send ``frames`` in order, each its own MAC'd frame, in as few system calls as the socket
        takes (a digested frame's bulk straight from its buffer). The deadlines treat the batch as one
        frame of their total length."""
        await _acquire(self._send_lock)
        try:
            self._check_open()
            parts: list[bytes | bytearray | memoryview] = []
            try:
                for data in frames:
                    if isinstance(data, DigestedFrame):
                        start, tag = self._sealer.seal_digested(data)
                        parts += (start, data.bulk, tag)
                    else:
                        header, tag = self._sealer.seal(data)
                        parts += (header, data, tag)
            except ProtocolError as exc:
                raise ChannelError(str(exc), reason=exc.reason) from exc
            with self._frame_scope() as scope:
                progress = _Progress(scope, self._deadlines, sum(len(data) for data in frames))
                try:
                    await self._io.write(parts, progress.moved)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    text = f"sending to {self.remote} failed: {exc}"
                    raise await self._fail("connection_lost", text) from exc
            if scope.cancelled_caught:
                raise await self._interrupted(progress, "sending to")
        finally:
            self._send_lock.release()

    async def receive_frame(self) -> bytes:
        """The next frame's bytes, checked (a digested frame's head and bulk joined). ChannelError reason
        ``closed`` when the peer closed between frames."""
        frame = await self.receive()
        return frame.joined() if isinstance(frame, DigestedFrame) else frame

    async def receive(self) -> Frame:
        """The next frame, checked; a digested frame as it came, with the digest of its bulk computed
        here. ChannelError reason ``closed`` when the peer closed between frames."""
        await _acquire(self._receive_lock)
        try:
            self._check_open()
            frame: Frame | None = None
            try:
                frame = self._buffered_frame()
            except ProtocolError as exc:
                raise await self._fail(exc.reason, f"frame from {self.remote} refused: {exc}") from exc
            if frame is not None:
                return frame
            with self._frame_scope() as scope:  # no deadline until the frame's first byte arrives
                progress = _Progress(scope, self._deadlines, None)
                try:
                    frame = await self._receive(progress)
                except ProtocolError as exc:
                    raise await self._fail(exc.reason, f"frame from {self.remote} refused: {exc}") from exc
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    if self.closed:  # closed on our side while a receive was waiting: not a failure
                        raise ChannelError(f"channel to {self.remote} is closed", reason="closed") from exc
                    text = f"receiving from {self.remote} failed: {exc}"
                    raise await self._fail("connection_lost", text) from exc
            if scope.cancelled_caught:
                raise await self._interrupted(progress, "receiving from")
            if frame is None:
                await self.aclose()
                raise ChannelError(f"{self.remote} closed the channel", reason="closed")
            return frame
        finally:
            self._receive_lock.release()

    def _buffered_frame(self) -> Frame | None:
        """The next frame if it is small and already whole in the read buffer (no I/O, no deadline)."""
        start = self._start
        if self._end - start < FRAME_HEADER.size:
            return None
        header = self._buffer[start : start + FRAME_HEADER.size]
        length = self._opener.body_length(header)
        body_start = start + FRAME_HEADER.size
        tag_start = body_start + length
        if length > SMALL_FRAME or tag_start + TAG_SIZE > self._end:
            return None
        tag = self._buffer[tag_start : tag_start + TAG_SIZE]
        frame: Frame
        if is_digested(header):
            head_end = body_start + HEAD_LENGTH.size
            head_end += self._opener.head_length(length, self._buffer[body_start:head_end])
            head = bytes(self._buffer[body_start + HEAD_LENGTH.size : head_end])
            bulk = bytes(self._buffer[head_end:tag_start])
            frame = DigestedFrame(head, bulk, self._opener.open_digested(length, head, bulk, tag))
        else:
            frame = bytes(self._buffer[body_start:tag_start])
            self._opener.open(length, frame, tag)
        self._start = tag_start + TAG_SIZE
        return frame

    async def _receive(self, progress: _Progress) -> Frame | None:
        """One frame, or None at a clean end of stream before its first byte."""
        if self._end > self._start:
            progress.start(0)
        if not await self._buffer_at_least(FRAME_HEADER.size, progress, eof_ok=True):
            return None
        start = self._start
        header = self._buffer[start : start + FRAME_HEADER.size]
        length = self._opener.body_length(header)
        progress.start(length)
        if length <= SMALL_FRAME:
            await self._buffer_at_least(FRAME_HEADER.size + length + TAG_SIZE, progress)
            frame = self._buffered_frame()
            assert frame is not None
            return frame
        check: FrameCheck | DigestedCheck
        if is_digested(header):
            # The head comes whole into the read buffer (it is at most MAX_DIGESTED_HEAD bytes); the bulk
            # then streams into its chunks like any large body, hashed as it arrives.
            field_end = FRAME_HEADER.size + HEAD_LENGTH.size
            await self._buffer_at_least(field_end, progress)
            head_length = self._opener.head_length(
                length, self._buffer[self._start + FRAME_HEADER.size : self._start + field_end]
            )
            await self._buffer_at_least(field_end + head_length, progress)
            head = bytes(self._buffer[self._start + field_end : self._start + field_end + head_length])
            self._start += field_end + head_length
            check = self._opener.begin_digested(length, head)
        else:
            self._start += FRAME_HEADER.size
            check = self._opener.begin(length)
        body = await self._receive_body(check.length, check, progress)
        await self._buffer_at_least(TAG_SIZE, progress)
        self._opener.finish(check, self._buffer[self._start : self._start + TAG_SIZE])
        self._start += TAG_SIZE
        if isinstance(check, DigestedCheck):
            return DigestedFrame(check.head, body, check.bulk_digest)
        return body

    async def _buffer_at_least(self, count: int, progress: _Progress, *, eof_ok: bool = False) -> bool:
        """Read until ``count`` unread bytes are buffered. False if the stream ends before the first byte
        and ``eof_ok``; the peer hanging up anywhere else is a truncation."""
        while self._end - self._start < count:
            if self._start:  # move the unread bytes to the front: what follows them must fit too
                unread = self._end - self._start
                self._buffer[:unread] = self._buffer[self._start : self._end]
                self._start, self._end = 0, unread
            view = memoryview(self._buffer)[self._end :]
            # Between frames (nothing of the next one yet) a peer may stay silent: wait for its first byte
            # without polling; once a frame has begun, the low-water mark and poll keep its deadline honest.
            expect = 1 if eof_ok and self._end == 0 else count - self._end
            read = await self._io.read([view], expect)
            if read == 0:
                if eof_ok and self._end == 0:
                    return False
                raise RemoteProtocolError("connection ended inside a frame", reason="truncated_frame")
            if self._end == 0:
                progress.start(0)
            self._end += read
            progress.moved()
        return True

    async def _receive_body(
        self, length: int, check: FrameCheck | DigestedCheck, progress: _Progress
    ) -> bytes:
        """The body, read into chunks allocated (and reserved from the budget) only as bytes arrive: the
        first is 256 KiB, each next one three times what has arrived so far, so a peer that announces 16
        MiB and sends one byte costs 256 KiB, and an honest 4 MiB frame takes three chunks. Bytes already
        in the read buffer go first; the last read also brings the tag and what follows into the buffer."""
        chunks: list[bytearray] = []
        received = reserved = 0
        try:
            while received < length:
                size = min(length - received, max(FIRST_CHUNK, received * (CHUNK_GROWTH - 1)))
                if not self.account.reserve(size):
                    text = f"no memory left for {self.remote}'s frame of {length} bytes"
                    raise await self._fail("memory_budget", text)
                reserved += size
                chunk = bytearray(size)
                chunks.append(chunk)
                await self._fill(memoryview(chunk), length - received, check, progress)
                received += size
            return bytes(chunks[0]) if len(chunks) == 1 else b"".join(chunks)
        finally:
            self.account.release(reserved)

    async def _fill(
        self, view: memoryview, left: int, check: FrameCheck | DigestedCheck, progress: _Progress
    ) -> None:
        """Fill ``view`` (part of a body that has ``left`` bytes still to come), buffered bytes first."""
        filled = min(len(view), self._end - self._start)
        if filled:
            view[:filled] = self._buffer[self._start : self._start + filled]
            check.update(view[:filled])
            self._start += filled
        if self._start == self._end:
            self._start = self._end = 0
        while filled < len(view):
            views = [view[filled:]]
            last = len(view) == left
            if last and self._start == self._end:  # the tag and later frames may come in the same read
                self._start = self._end = 0
                views.append(memoryview(self._buffer))
            count = await self._io.read(views, left - filled + TAG_SIZE)
            if count == 0:
                raise RemoteProtocolError("connection ended inside a frame", reason="truncated_frame")
            taken = min(count, len(view) - filled)
            check.update(view[filled : filled + taken])
            filled += taken
            if count > taken:
                self._end = count - taken
            progress.moved()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._joined_frames()

    async def frames(self) -> AsyncIterator[Frame]:
        """Frames as ``receive`` gives them (digested ones kept apart) until the peer closes cleanly
        between frames; any other failure raises."""
        while True:
            try:
                yield await self.receive()
            except ChannelError as exc:
                if exc.reason == "closed":
                    return
                raise

    async def _joined_frames(self) -> AsyncIterator[bytes]:
        """``frames`` as bytes (as ``receive_frame`` gives them)."""
        async for frame in self.frames():
            yield frame.joined() if isinstance(frame, DigestedFrame) else frame

    async def aclose(self) -> None:
        self.closed = True
        self.account.close()
        await self._stream.aclose()

    def _frame_scope(self) -> _FrameScope:
        """A cancel scope for one frame: its deadline follows the frame's progress, eviction cancels it."""
        return _FrameScope(self._scopes)

    def _evict(self) -> None:
        """The budget took this channel's memory back: stop what it is doing; it fails from now on."""
        self.evicted = True
        for scope in self._scopes:
            scope.cancel()
        if self.on_evict is not None:
            self.on_evict()

    async def _interrupted(self, progress: _Progress, doing: str) -> ChannelError:
        if self.evicted:
            return await self._fail(
                "memory_budget", f"{doing} {self.remote}: evicted to keep the node's memory budget"
            )
        reason, why = progress.reason()
        return await self._fail(reason, f"{doing} {self.remote}: {why}")

    def _check_open(self) -> None:
        if self.evicted:
            raise ChannelError(f"channel to {self.remote} was evicted", reason="memory_budget")
        if self.closed:
            raise ChannelError(f"channel to {self.remote} is closed", reason="closed")

    async def _fail(self, reason: str, text: str) -> ChannelError:
        # Once: the other direction's task fails too when the channel closes under it.
        log.log(
            logging.DEBUG if self.closed else logging.WARNING, "data plane: %s (%s); closing", text, reason
        )
        with trio.CancelScope(shield=True):
            await self.aclose()
        return ChannelError(text, reason=reason)


class _FrameScope:
    """A trio CancelScope registered in ``scopes`` while it is open (a class, not a generator-based
    context manager: it is entered for every frame that needs I/O)."""

    def __init__(self, scopes: set[trio.CancelScope]) -> None:
        self._scopes = scopes
        self._scope = trio.CancelScope()

    def __enter__(self) -> trio.CancelScope:
        self._scopes.add(self._scope)
        return self._scope.__enter__()

    def __exit__(self, *exc_info: Any) -> bool:
        self._scopes.discard(self._scope)
        return bool(self._scope.__exit__(*exc_info))


async def _acquire(lock: trio.Lock) -> None:
    """Take ``lock``, without a pass through the scheduler when it is free (once per frame adds up)."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


class _Progress:
    """Moves a frame's cancel-scope deadline: ``idle`` seconds after the last bytes moved, never past the
    frame's own allowance. ``length`` None: not started (a receiver waiting for the next frame)."""

    def __init__(self, scope: trio.CancelScope, deadlines: FrameDeadlines, length: int | None) -> None:
        self._scope = scope
        self._deadlines = deadlines
        self._began = 0.0
        self._end = math.inf
        if length is not None:
            self.start(length)

    def start(self, length: int) -> None:
        """The frame began (at its first byte; called again once its length is known)."""
        if self._end == math.inf:
            self._began = trio.current_time()
        self._end = self._began + self._deadlines.allowance(length)
        self.moved()

    def moved(self) -> None:
        """Bytes moved. The deadline is pushed back only once a quarter of ``idle`` has passed since it
        was set (cheap at thousands of reads per frame), so a silence of ``idle`` seconds is always
        caught and one shorter than ``idle * 3 / 4`` never is."""
        idle = self._deadlines.idle
        target = min(self._end, trio.current_time() + idle)
        deadline = self._scope.deadline
        if target != deadline and (target < deadline or target == self._end or target - deadline > idle / 4):
            self._scope.deadline = target

    def reason(self) -> tuple[str, str]:
        if trio.current_time() >= self._end:
            allowed = self._end - self._began
            return "frame_too_slow", f"a frame took longer than its {allowed:.0f} s"
        return "frame_stalled", f"no bytes moved for {self._deadlines.idle:.0f} s inside a frame"
