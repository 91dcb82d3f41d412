"""JSON from disk or the network with its nesting bounded before it is parsed.

``json.loads`` recurses once per nesting level in C. It is guarded only by the interpreter's recursion
limit, which libraries raise process-wide (py_ecc sets 100,000): a file of 100,000 ``[`` then crashes
the process with a segmentation fault instead of raising. Our own files nest a few levels deep.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64


def nesting_depth(raw: str | bytes) -> int:
    """The deepest ``[``/``{`` nesting of ``raw`` outside strings (a linear scan, no recursion)."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def loads_bounded(raw: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` that raises ValueError for nesting deeper than ``max_depth``."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    opening = text.count("[") + text.count("{")
    if opening > max_depth and nesting_depth(text) > max_depth:  # the count alone clears most inputs
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    return json.loads(raw)
