"""py-libp2p's yamux flow control, set the way go-yamux does it.

py-libp2p 0.8.1 sends a WINDOW_UPDATE frame back for every read of a stream by default
(``PY_YAMUX_RELEASE_ON_READ``, on), so each small message (a gossip RPC, a heartbeat) costs a second
frame: a Noise encryption and a write one way, a decryption and a frame parse the other. With the switch
off it returns credit per half window, except that its "partial slack" rule still answers about every
other small read (measured: 306 updates for 600 echoed 1 KiB frames, 604 with the switch on). A
neighbour link's beat is one small read, so an idle node still answered every other beat with a frame of
its own. ``credit_per_half_window`` replaces that decision with go-yamux's (``sendWindowUpdate``: credit
goes back once the bytes read and not yet returned reach half the target window), keeping py-libp2p's
window auto-tuning: 9 updates for the same frames. A sender never stalls: one whose window ran out has had
all of it read, which is more than half.

py-libp2p reads the switch from the environment each time it decides, so it is set there, before the
host runs; a value the user set (their own tuning or py-libp2p's perf harness) is left alone.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

log = logging.getLogger(__name__)
RELEASE_ON_READ = "PY_YAMUX_RELEASE_ON_READ"
"""py-libp2p's switch (libp2p/stream_muxer/yamux/yamux.py): "0" returns window credit per half window."""
PATCHED_FOR = "0.8.1"
"""The py-libp2p version whose ``YamuxStream`` internals ``credit_per_half_window`` was written against."""


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
    import libp2p
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    version = getattr(libp2p, "__version__", None)
    if version != PATCHED_FOR:
        log.info("py-libp2p %s, not %s: its own yamux window credit rule stays", version, PATCHED_FOR)
        return False
    YamuxStream._auto_tune_and_send_window_update = _credit_per_half_window  # type: ignore[method-assign,assignment]
    return True
