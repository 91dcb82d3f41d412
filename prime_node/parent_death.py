"""Children that die with their parent: a process tree never outlives the process that started it."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def death_signal_setter(signum: int) -> Callable[[], None] | None:
    """A call that asks the kernel to send ``signum`` to the calling process when its parent dies
    (Linux; None elsewhere). libc is looked up here, in the parent, so the call is safe between fork and
    exec (``preexec_fn``: the child runs no import, nothing that takes a lock) and in a process itself."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signum)

    return set_death_signal
