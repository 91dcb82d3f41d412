"""Which implementation codes chunks: the compiled kernels (``delta_kernels``) or numpy, once per process.

The kernels need numba, a heavy import: loading them costs ~0.8 CPU-s per process from numba's cache
(compiling them, once per install, tens of seconds), and they save ~2 CPU-s per GB coded. So they are
loaded when a file of ``COMPILED_FROM_BYTES`` or more is coded (``load_for``): a small model's deltas (the
demo's, the tests') never pay for them. From then on every chunk of the process uses them
(``current``). A node without numba (or with ``PRIME_NODE_DELTA_KERNELS=numpy``) codes with numpy, the
reference (slower: docs/deltas.md); ``PRIME_NODE_DELTA_KERNELS=numba`` asks for the kernels at any size.
Both give the same bytes.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from types import ModuleType

ENV = "PRIME_NODE_DELTA_KERNELS"
KERNELS_MODULE = "prime_node.swarm.delta_kernels"
COMPILED_FROM_BYTES = 256 << 20
"""Files at least this big load the compiled kernels (their cost per process is repaid in ~0.4 GB)."""
log = logging.getLogger(__name__)


@functools.cache
def kernels() -> ModuleType | None:
    """``delta_kernels`` if numba loads and ``PRIME_NODE_DELTA_KERNELS`` is not ``numpy``; else None."""
    if os.environ.get(ENV, "").strip().lower() == "numpy":
        return None
    try:  # by name: numba is loaded here, on first use, not by whoever imports the codec
        return importlib.import_module(KERNELS_MODULE)
    except (ImportError, RuntimeError, OSError) as exc:  # missing, or no place to cache the kernels
        log.info("delta codec: numba unavailable (%s), coding chunks with numpy", exc)
        return None


def load_for(file_bytes: int) -> None:
    """Load the compiled kernels before coding a file of ``file_bytes`` if it is big enough to repay them."""
    if file_bytes >= COMPILED_FROM_BYTES:
        kernels()


def current() -> ModuleType | None:
    """The kernels chunks are coded with now: the compiled ones once loaded (``load_for``, or asked for
    with ``PRIME_NODE_DELTA_KERNELS=numba``) and allowed (``kernels``), else None (numpy)."""
    asked = os.environ.get(ENV, "").strip().lower() == "numba"
    return kernels() if asked or KERNELS_MODULE in sys.modules else None
