"""prime-node processes for tests, forked ready from the session's warm-start server (prime_node/warm_start).

A test that starts ``python -m prime_node ...`` processes gets the same processes (real pids, their own
sessions, the test's stdio, environment and directory) without each importing torch, transformers and
libp2p again: about 5-10 CPU-seconds per process on a 2-core machine. A command line that is not a
prime-node entry point, or an environment that differs in what libraries read at import (e.g.
``OMP_NUM_THREADS``), starts cold through ``subprocess`` exactly as before. ``PRIME_NODE_WARM_START=0``
turns warm starts off for a whole run (then every process starts cold).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import Any

from prime_node.warm_start.launcher import WarmStart
from prime_node.warm_start.process import WarmProcess

_WARM_OPTIONS = frozenset({"stdin", "stdout", "stderr", "env", "cwd", "text"})
"""What a warm start honours; a call with any other option (preexec_fn, pass_fds...) starts cold.
``start_new_session`` is what a warm child always has."""


def popen(argv: Sequence[str], **options: Any) -> subprocess.Popen[Any] | WarmProcess:
    """``subprocess.Popen(argv, **options)``, forked from the session's warm-start server when it can be
    (tests/conftest.py names the server in the environment)."""
    warm = WarmStart.attach()
    warm_options = {key: value for key, value in options.items() if key != "start_new_session"}
    if warm is not None and warm_options.get("env") is not None:
        # the process's own prime-node children (--local's inference worker) are forked warm too
        warm_options["env"] = warm.child_env(warm_options["env"])
    if warm is not None and set(warm_options) <= _WARM_OPTIONS:
        process = warm.popen(argv, **warm_options)
        if process is not None:
            return process
    return subprocess.Popen(list(argv), **options)


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    input: str | bytes | None = None,
    capture_output: bool = False,
    check: bool = False,
    **options: Any,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` with a required timeout, through ``popen``."""
    if capture_output:
        options.setdefault("stdout", subprocess.PIPE)
        options.setdefault("stderr", subprocess.PIPE)
    if input is not None:
        options.setdefault("stdin", subprocess.PIPE)
    process = popen(argv, **options)
    try:
        out, err = process.communicate(input=input, timeout=timeout)
    except BaseException:
        process.kill()
        process.wait()
        raise
    done = subprocess.CompletedProcess(list(argv), process.returncode or 0, out, err)
    if check:
        done.check_returncode()
    return done
