"""Model work in worker threads that a stopping role leaves at once (issue 36).

A generation or a prefill of a real-size model runs for many seconds in a worker thread. A trio thread
call without ``abandon_on_cancel`` makes a cancelled role wait for it, so Ctrl-C/SIGTERM (or a role
switch) waited that long and could hit the node's 5 s shutdown watchdog. ``run_model_work`` abandons the
thread when its caller is cancelled: the result is discarded, and the thread only touches the role's own
engine and counters, which nothing uses once the role is gone (it writes no file). To stop the abandoned
work too, and free its CPU or GPU for whatever runs next (the next role), cancellation sets the role's
``ModelStop``: every model the role computes with checks it before each forward pass of its decoder
(``guard``), which is between two generated tokens or two prefill chunks, and raises
``ModelWorkStoppedError`` in the abandoned thread.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from prime_node.errors import NodeError

T = TypeVar("T")


class ModelWorkStoppedError(NodeError):
    """Raised inside abandoned model work once its role has stopped."""

    def __init__(self) -> None:
        super().__init__("model work stopped: its role is stopping", reason="stopped")


class ModelStop:
    """One role's stop flag for its model work (module doc); set once, never cleared."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._guarded: weakref.WeakSet[Any] = weakref.WeakSet()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """ModelWorkStoppedError once the role has stopped (call between units of model work)."""
        if self._event.is_set():
            raise ModelWorkStoppedError

    def guard(self, engine: Any) -> None:
        """Check the flag before every forward pass of ``engine``'s decoder (its model's, or the model
        itself when it has no decoder): between generated tokens, and between prefill chunks. Once per
        module; an engine without a torch model is left as it is."""
        model = getattr(engine, "model", None)
        if model is None:
            return
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        if not hasattr(decoder, "register_forward_pre_hook") or decoder in self._guarded:
            return
        self._guarded.add(decoder)
        decoder.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: Any, args: Any) -> None:
        self.check()


async def run_model_work(stop: ModelStop, work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` in a worker thread; if the caller is cancelled, abandon the thread and set
    ``stop`` so the work ends at its next check (module doc)."""
    try:
        return await trio.to_thread.run_sync(work, *args, abandon_on_cancel=True)  # type: ignore[call-arg, unused-ignore]
    except trio.Cancelled:
        stop.set()
        raise
