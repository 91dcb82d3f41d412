"""py-libp2p 0.8.1's yamux, set closer to go-yamux: fewer window updates, and a message written whole or
not at all.

**Credit.** py-libp2p sends a WINDOW_UPDATE frame back for every read of a stream by default
(``PY_YAMUX_RELEASE_ON_READ``, on), so each small message (a gossip RPC, a heartbeat) costs a second frame:
a Noise encryption and a write one way, a decryption and a frame parse the other. With the switch off it
returns credit per half window read, except that its "partial slack" rule still answers about every other
small read (306 updates for 600 echoed 256-byte frames, 604 with the switch on). py-libp2p reads the
switch from the environment each time it decides, so ``tune_yamux`` sets it there, before the host runs;
a value the user set (their own tuning or py-libp2p's perf harness) is left alone.
``credit_per_half_window`` then replaces the partial-slack decision with go-yamux's own
(``sendWindowUpdate``: credit goes back once the bytes read and not yet returned reach half the target
window), keeping py-libp2p's window auto-tuning: 9 updates for the same frames. A sender whose window ran
out gets credit once its reader has taken half of what it sent, as in go-yamux. On a saturated machine this
is what lets 64 processes form in ~5 heartbeat intervals instead of ~17 (docs/benchmarks.md, issue 16).

**Whole writes** (``whole_writes``). py-libp2p's ``YamuxStream.write`` sends a message in parts of at most
the window, and lets any other writer of the stream in between two parts; after 5 s without window it
gives up with part of the message sent and leaves the stream open. Either way the reader takes what
follows for the rest of a message it got only the start of: a pubsub RPC that does not parse, a frame of
ours that never completes. go-yamux's credit rule made both likelier (a window runs out more often), and
the flood demo test then hung: the RPCs that did not parse failed the validator's host (docs/security.md,
*A stream handler that fails*). Now one ``write`` holds the stream until its message is sent, and one that
gives up resets the stream, so the reader sees the stream end, not garbage.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import MutableMapping
from typing import Any

import trio

log = logging.getLogger(__name__)

PATCHED_FOR = "0.8.1"
"""The py-libp2p version whose ``YamuxStream`` internals the patches here were written against."""
WRITE_STALLED = "Timed out waiting for window update"
"""How py-libp2p 0.8.1's ``YamuxStream.write`` says it gave up waiting for window."""
RELEASE_ON_READ = "PY_YAMUX_RELEASE_ON_READ"
"""py-libp2p's switch (libp2p/stream_muxer/yamux/yamux.py): "0" returns window credit per half window."""


def tune_yamux(environ: MutableMapping[str, str]) -> bool:
    """Window updates per half window instead of per read, unless ``environ`` already says otherwise.
    Call with ``os.environ`` before py-libp2p opens connections (the setting is process-wide there).
    True when credit goes per half window: then install ``credit_per_half_window`` too."""
    environ.setdefault(RELEASE_ON_READ, "0")
    return environ[RELEASE_ON_READ].upper() in ("0", "FALSE", "NO")


async def _credit_per_half_window(stream: Any, *, bytes_read: int = 0) -> None:
    """``YamuxStream._auto_tune_and_send_window_update`` without the per-read rules: return credit only
    when what was read and not yet returned reaches the growth threshold (half the target window)."""
    total = 0
    async with stream.window_lock:
        buffered = len(stream.conn.stream_buffers.get(stream.stream_id, b""))
        unreturned = stream.target_recv_window - (stream.recv_window + buffered)
        if unreturned > 0 and unreturned >= stream._grow_threshold():
            stream._window_update_full_grow += 1
            total = stream._grow_to_delta(buffered) + stream._apply_autotune_epoch(buffered)
    if total > 0:
        await stream.send_window_update(total, skip_lock=True)


def credit_per_half_window() -> bool:
    """Install go-yamux's credit rule on py-libp2p's ``YamuxStream`` (idempotent); False, with a log line,
    on a py-libp2p other than ``PATCHED_FOR`` (its own rule then stays)."""
    if not _patchable("window credit rule"):
        return False
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    YamuxStream._auto_tune_and_send_window_update = _credit_per_half_window  # type: ignore[method-assign,assignment]
    return True


def _patchable(what: str) -> bool:
    import libp2p

    version = getattr(libp2p, "__version__", None)
    if version != PATCHED_FOR:
        log.info("py-libp2p %s, not %s: its own yamux %s stays", version, PATCHED_FOR, what)
        return False
    return True


def whole_writes() -> bool:
    """One ``YamuxStream.write`` at a time per stream, and a write that gave up waiting for window resets
    its stream (see the module doc); idempotent. False, with a log line, on a py-libp2p other than
    ``PATCHED_FOR``."""
    if not _patchable("write"):
        return False
    from libp2p.stream_muxer.exceptions import MuxedStreamError
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    if getattr(YamuxStream.write, "writes_whole", False):
        return True
    write = YamuxStream.write

    async def write_whole(stream: Any, data: bytes) -> None:
        lock = stream.__dict__.get("_whole_write")
        if lock is None:
            lock = stream.__dict__.setdefault("_whole_write", trio.Lock())
        async with lock:
            try:
                await write(stream, data)
            except MuxedStreamError as exc:
                if WRITE_STALLED in str(exc):
                    with contextlib.suppress(Exception):
                        await stream.reset()
                raise

    write_whole.writes_whole = True  # type: ignore[attr-defined]
    YamuxStream.write = write_whole  # type: ignore[method-assign,assignment]
    return True
