"""What both broadcast peer scripts need to talk to the harness: JSON report lines on stdout, their own
CPU time, and command lines from stdin."""

from __future__ import annotations

import json
import resource
from collections.abc import AsyncIterator
from typing import Any

import trio


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def stdin_lines(stdin: trio.lowlevel.FdStream) -> AsyncIterator[str]:
    buffer = b""
    while True:
        chunk = await stdin.receive_some(4096)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line.decode().strip()
