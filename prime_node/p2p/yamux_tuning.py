"""py-libp2p 0.8.1's yamux, set closer to go-yamux: fewer window updates, and a message written whole or
not at all.

**Credit.** py-libp2p sends a WINDOW_UPDATE frame back for every read of a stream by default
(``PY_YAMUX_RELEASE_ON_READ``, on), so each small message (a gossip RPC, a heartbeat) costs a second frame:
a Noise encryption and a write one way, a decryption and a frame parse the other. With the switch off it
returns credit per half window read, except that its "partial slack" rule still answers about every other
small read (306 updates for 600 echoed 256-byte frames, 604 with the switch on). py-libp2p reads the
switch from the environment each time it decides, so ``tune_yamux`` sets it there, before the host runs;
a value the user set (their own tuning or py-libp2p's perf harness) is left alone. Replacing the
partial-slack decision with go-yamux's own (credit only per half window: 9 updates for the same frames)
is not in: see docs/running-a-node.md, *What an idle node costs*.

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


def tune_yamux(environ: MutableMapping[str, str]) -> None:
    """Window updates per half window instead of per read, unless ``environ`` already says otherwise.
    Call with ``os.environ`` before py-libp2p opens connections (the setting is process-wide there)."""
    environ.setdefault(RELEASE_ON_READ, "0")


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
