"""py-libp2p's yamux flow control, set the way go-yamux does it.

py-libp2p 0.8.1 sends a WINDOW_UPDATE frame back for every read of a stream by default
(``PY_YAMUX_RELEASE_ON_READ``, on), so each small message (a gossip RPC, a heartbeat) costs a second
frame: a Noise encryption and a write one way, a decryption and a frame parse the other. With the switch
off it returns credit as go-yamux does, per half window read, except that its "partial slack" rule still
answers about every other small read (measured: 306 updates for 600 echoed 256-byte frames, 604 with the
switch on). A sender never stalls either way: the window it waits on is the one being returned.

py-libp2p reads the switch from the environment each time it decides, so it is set there, before the
host runs; a value the user set (their own tuning or py-libp2p's perf harness) is left alone.

``reset_stalled_writes``: a yamux ``write`` that waits 5 s for window gives up with part of its data sent
and leaves the stream open, so the reader, once it reads again, takes the rest of the stream for the
continuation of a message it only got the start of (a pubsub RPC that does not parse, a frame of ours
that does not decode). On py-libp2p 0.8.1 such a write now resets its stream first: the reader sees the
stream end, not garbage.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import MutableMapping
from typing import Any

log = logging.getLogger(__name__)

PATCHED_FOR = "0.8.1"
"""The py-libp2p version whose ``YamuxStream.write`` ``reset_stalled_writes`` was written against."""
WRITE_STALLED = "Timed out waiting for window update"
"""How py-libp2p 0.8.1's ``YamuxStream.write`` says it gave up waiting for window."""
RELEASE_ON_READ = "PY_YAMUX_RELEASE_ON_READ"
"""py-libp2p's switch (libp2p/stream_muxer/yamux/yamux.py): "0" returns window credit per half window."""


def tune_yamux(environ: MutableMapping[str, str]) -> None:
    """Window updates per half window instead of per read, unless ``environ`` already says otherwise.
    Call with ``os.environ`` before py-libp2p opens connections (the setting is process-wide there)."""
    environ.setdefault(RELEASE_ON_READ, "0")


def reset_stalled_writes() -> bool:
    """Make a yamux write that gave up waiting for window reset its stream (see the module doc); idempotent.
    False, with a log line, on a py-libp2p other than ``PATCHED_FOR`` (its own behaviour then stays)."""
    import libp2p
    from libp2p.stream_muxer.exceptions import MuxedStreamError
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    version = getattr(libp2p, "__version__", None)
    if version != PATCHED_FOR:
        log.info("py-libp2p %s, not %s: a stalled yamux write keeps its stream open", version, PATCHED_FOR)
        return False
    if getattr(YamuxStream.write, "resets_when_stalled", False):
        return True
    write = YamuxStream.write

    async def write_or_reset(stream: Any, data: bytes) -> None:
        try:
            await write(stream, data)
        except MuxedStreamError as exc:
            if WRITE_STALLED in str(exc):
                with contextlib.suppress(Exception):
                    await stream.reset()
            raise

    write_or_reset.resets_when_stalled = True  # type: ignore[attr-defined]
    YamuxStream.write = write_or_reset  # type: ignore[method-assign,assignment]
    return True
