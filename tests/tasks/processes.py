"""Finding a sandboxed program's processes from outside: each test's program names itself with a tag of
its own (``prctl(PR_SET_NAME)``, inherited by whatever it forks), so a test sees its own processes and
not those of another test running beside it (the suite runs on several xdist workers)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

LINGER_S = 10.0
"""How long processes the kernel is still tearing down (a PID namespace whose init was killed) may take
to go: a guard against a hang, far above the few ms that takes."""


def new_tag() -> str:
    """A process name no other test uses (15 characters: the kernel's limit)."""
    return f"pnsb{uuid.uuid4().hex[:11]}"


def naming_prelude(tag: str) -> str:
    """Python source that names the running process ``tag``: put it before a program."""
    return f"import ctypes\nctypes.CDLL(None).prctl(15, {tag!r}.encode()[:15], 0, 0, 0)\n"


def processes_named(tag: str) -> list[int]:
    """Live (not zombie) processes whose name is ``tag``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                name, state = (entry / "stat").read_text().rsplit(")", 1)
            except OSError:
                continue
            if name.split("(", 1)[1] == tag[:15] and state.split()[0] != "Z":
                found.append(int(entry.name))
    return found


def processes_left(tag: str) -> list[int]:
    """``processes_named(tag)`` once none is left, or after ``LINGER_S``."""
    deadline = time.monotonic() + LINGER_S
    while (left := processes_named(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left
