"""Prometheus lines for the numeric values of the status sections.

Generic, so a new section gets metrics without code here: ``sections.<name>.<key> = number`` becomes
``prime_node_<name>_<key> number``; ``{label: number}`` maps (rejections by reason, accepts by worker)
become one sample per label. A few list-valued fields are summarised: the last point of the reward and
held-out curves, per-step piece counts of checkpoint versions, and the role as an info metric. Values are
read defensively and the output is bounded, so an odd section costs a few lines, never the endpoint.
"""

from __future__ import annotations

import re
from typing import Any

from prime_node.status.values import MAX_ENTRIES, as_dict, as_list, as_num, as_text, series

MAX_SECTIONS = 16
_NAME = re.compile(r"[^a-zA-Z0-9_]")
# Families prometheus_text writes itself; a section must not add samples to them.
RESERVED = frozenset(
    {
        "prime_node_up",
        "prime_node_uptime_seconds",
        "prime_node_connected_peers",
        "prime_node_peers",
        "prime_node_events_total",
        "prime_node_rejections_total",
    }
)


def _metric(*parts: str) -> str:
    cleaned = (_NAME.sub("_", part).strip("_").lower() for part in parts)
    name = re.sub(r"_+", "_", "_".join(part for part in cleaned if part))
    return "prime_node_" + name if name else ""


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _format(number: float) -> str:
    number = float(number)
    return str(int(number)) if number.is_integer() and abs(number) < 1 << 53 else repr(number)


def section_samples(sections: Any) -> dict[str, list[str]]:
    """Metric family name -> its sample lines, from a snapshot's ``sections``."""
    families: dict[str, list[str]] = {}
    seen: set[str] = set()

    def add(name: str, value: float, labels: str = "") -> None:
        if not name or name in RESERVED or name + labels in seen:  # names normalise alike: keep the first
            return
        seen.add(name + labels)
        families.setdefault(name, []).append(f"{name}{labels} {_format(value)}")

    for section_name, section in list(as_dict(sections).items())[:MAX_SECTIONS]:
        data = as_dict(section)
        if section_name == "role" and (role := as_text(data.get("role"), 16)):
            add(_metric("role"), 1, f'{{role="{_label(role)}"}}')
        for key, value in list(data.items())[: MAX_ENTRIES * 2]:
            name = _metric(section_name, key)
            if (number := as_num(value)) is not None:
                add(name, number)
            elif isinstance(value, dict):
                label = "reason" if "rejected" in key else "key"
                for item, count in list(as_dict(value).items())[:MAX_ENTRIES]:
                    if (amount := as_num(count)) is not None:
                        add(name, amount, f'{{{label}="{_label(as_text(item, 64))}"}}')
            elif points := series(value):
                add(_metric(section_name, key, "last"), points[-1][1])
        if section_name == "checkpoints":
            for version in (as_dict(v) for v in as_list(data.get("versions"))[-8:]):
                step = as_num(version.get("step"))
                if step is None:
                    continue
                for field in ("have", "pieces"):
                    if (amount := as_num(version.get(field))) is not None:
                        add(_metric("checkpoint", field), amount, f'{{step="{int(step)}"}}')
    return families


def section_lines(sections: Any) -> list[str]:
    lines = []
    for name, samples in section_samples(sections).items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(samples)
    return lines
