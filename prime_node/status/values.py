"""Defensive readers for status documents: sections come from other services (or other versions of the
node), so every value is checked for its type and bounded before it is shown; anything odd reads as
missing rather than raising."""

from __future__ import annotations

import math
from typing import Any

MAX_TEXT = 120
MAX_ENTRIES = 24
MAX_SERIES = 4096


def as_dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {}
    return {key: item for key, item in value.items() if isinstance(key, str)}


def as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def as_num(value: Any) -> float | None:
    """A finite number (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return number if math.isfinite(number) else None


def as_int(value: Any) -> int | None:
    number = as_num(value)
    return None if number is None else int(number)


def as_text(value: Any, limit: int = MAX_TEXT) -> str:
    """A one-line string, cut to ``limit`` characters; non-strings read as empty."""
    if not isinstance(value, str):
        return ""
    line = "".join(ch if ch.isprintable() else " " for ch in value[: limit * 4])
    return line if len(line) <= limit else line[: limit - 1] + "…"


def counts(value: Any, limit: int = MAX_ENTRIES) -> dict[str, int]:
    """A ``{name: count}`` mapping, largest first, at most ``limit`` entries."""
    pairs = [(as_text(key, 48), as_int(item)) for key, item in as_dict(value).items()]
    valid = [(key, number) for key, number in pairs if key and number is not None]
    valid.sort(key=lambda pair: (-pair[1], pair[0]))
    return dict(valid[:limit])


def series(value: Any) -> list[tuple[float, float]]:
    """``[[x, y], ...]`` pairs of finite numbers (the last MAX_SERIES), skipping anything else."""
    points = []
    for item in as_list(value)[-MAX_SERIES:]:
        pair = as_list(item)
        if len(pair) == 2:
            x, y = as_num(pair[0]), as_num(pair[1])
            if x is not None and y is not None:
                points.append((x, y))
    return points


def short(text: str, keep: int = 10) -> str:
    return text if len(text) <= 2 * keep + 1 else f"{text[:keep]}…{text[-keep:]}"


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def compact(value: Any, limit: int = MAX_TEXT) -> str:
    """Any JSON-like value as one short line of values, never a Python type name: ``a=1, b=yes``,
    ``x, y (+3)``, ``-`` for nothing. The status panels of sections the TUI has no view for use it."""
    text = _compact(value, depth=0)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _compact(value: Any, depth: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if (number := as_num(value)) is not None:
        return f"{number:g}" if isinstance(value, float) else str(int(number))
    if isinstance(value, str):
        return as_text(value) or '""'
    if depth >= 2:  # deeper structure: only how much there is
        size = len(value) if isinstance(value, dict | list | tuple) else 0
        return f"{{{size}}}" if isinstance(value, dict) else f"[{size}]"
    if isinstance(value, dict):
        items = list(as_dict(value).items())
        shown = [f"{as_text(key, 32)}={_compact(item, depth + 1)}" for key, item in items[:8]]
        more = f" (+{len(items) - 8})" if len(items) > 8 else ""
        return ("{" + ", ".join(shown) + more + "}") if depth else (", ".join(shown) + more or "-")
    if isinstance(value, list | tuple):
        shown = [_compact(item, depth + 1) for item in list(value)[:6]]
        more = f" (+{len(value) - 6})" if len(value) > 6 else ""
        return ", ".join(shown) + more if shown else "none"
    return "-"
