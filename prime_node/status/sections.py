"""Rich views of the status "sections" (role, checkpoints, rollouts, validation, training).

Each view reads its section through ``values`` (wrong types read as missing), so an odd or partial
section renders as what it has, never as an exception. Strings from the document always go into ``Text``
objects, never into markup, so a reason like ``[bold]`` is shown as typed.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from prime_node.status.values import (
    MAX_ENTRIES,
    as_dict,
    as_int,
    as_list,
    as_num,
    as_text,
    compact,
    counts,
    format_bytes,
    series,
    short,
)

SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 48
MAX_BINS = 64
MAX_VERSIONS = 8
MAX_ANNOUNCERS = 8
_AVAILABILITY = (("·", "red"), ("░", "yellow"), ("▒", "cyan"), ("▓", "green"), ("█", "bold green"))
_CHECKPOINT_STYLE = {"complete": "green", "seeding": "green", "fetching": "yellow"}
KNOWN = ("role", "checkpoints", "rollouts", "validation", "training")

# (label, section, key, unit) of counters shown as per-second rates between refreshes.
SECTION_RATES = (
    ("rollouts produced", "rollouts", "produced", "batch"),
    ("rollouts accepted", "rollouts", "accepted", "batch"),
    ("validated", "validation", "validated", "batch"),
    ("batches trained", "training", "batches_accepted", "batch"),
    ("checkpoint bytes in", "checkpoints", "bytes_in", "bytes"),
    ("checkpoint bytes out", "checkpoints", "bytes_out", "bytes"),
)


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """Values as block characters, averaged into at most ``width`` cells, scaled between min and max."""
    if not values:
        return ""
    if len(values) > width:
        size = len(values) / width
        values = [
            sum(chunk) / len(chunk)
            for chunk in (
                values[int(i * size) : max(int((i + 1) * size), int(i * size) + 1)] for i in range(width)
            )
        ]
    low, high = min(values), max(values)
    if high - low <= 0:
        return SPARK[3] * len(values)
    return "".join(SPARK[round((v - low) / (high - low) * (len(SPARK) - 1))] for v in values)


def availability_bar(bins: Any, cells: int = MAX_BINS) -> Text:
    """One cell per bin (re-bucketed to <= ``cells`` by taking the minimum), shaded by peers holding it."""
    raw = as_list(bins)
    cells = max(1, min(cells, MAX_BINS))
    if len(raw) > cells:
        size = len(raw) / cells
        raw = [raw[int(i * size) : max(int((i + 1) * size), int(i * size) + 1)] for i in range(cells)]
        raw = [min((v for v in map(as_int, chunk) if v is not None), default=None) for chunk in raw]
    bar = Text()
    for value in raw:
        peers = as_int(value)
        if peers is None or peers < 0:
            bar.append("?", style="dim")
        else:
            char, style = _AVAILABILITY[min(peers, len(_AVAILABILITY) - 1)]
            bar.append(char, style=style)
    return bar


def _counts_text(mapping: dict[str, int]) -> Text:
    return Text(", ".join(f"{key}={value}" for key, value in mapping.items()) or "-")


def _number(value: Any, digits: int = 0) -> str:
    number = as_num(value)
    if number is None:
        return "-"
    return f"{number:.{digits}f}" if digits else f"{int(number)}"


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    return grid


def _error(section: dict[str, Any]) -> Text | None:
    error = as_text(section.get("error"))
    return Text(f"error: {error}", style="red") if error else None


def _profile_text(profile: dict[str, Any]) -> Text:
    gpus = [as_dict(gpu) for gpu in as_list(profile.get("gpus"))[:MAX_ENTRIES]]
    parts = []
    if gpus:
        names: dict[str, int] = {}
        for gpu in gpus:
            vram = (as_num(gpu.get("vram_mib")) or 0) / 1024
            label = f"{as_text(gpu.get('name'), 40) or 'GPU'} ({vram:.1f} GiB)"
            names[label] = names.get(label, 0) + 1
        parts.append(", ".join(f"{count}x {label}" for label, count in names.items()))
    else:
        parts.append("no GPU")
    if (cores := as_int(profile.get("cpu_cores"))) is not None:
        parts.append(f"{cores} cores")
    if (ram := as_num(profile.get("ram_mib"))) is not None:
        parts.append(f"{ram / 1024:.1f} GiB RAM")
    if (disk := as_num(profile.get("disk_free_mib"))) is not None:
        parts.append(f"{disk / 1024:.0f} GiB free disk")
    return Text(", ".join(parts))


def role_view(section: Any) -> RenderableType:
    data = as_dict(section)
    grid = _grid()
    if (error := _error(data)) is not None:
        grid.add_row("error", error)
    grid.add_row("role", Text(as_text(data.get("role"), 16) or "?", style="bold cyan"))
    grid.add_row("why", Text(as_text(data.get("reason"), 480) or "-"))
    if device := as_text(data.get("device"), 32):
        grid.add_row("device", Text(device))
    if "trainer" in data:
        grid.add_row("trainer", Text(as_text(data.get("trainer"), 42) or "none pinned"))
    for row in map(as_dict, as_list(data.get("announcements"))[:MAX_ANNOUNCERS]):
        if not (run := as_text(row.get("run"), 120)):
            continue
        believed = row.get("followed") is True
        line = Text(run, style="green" if believed else "yellow")
        line.append(" followed" if believed else " not followed")
        if (count := as_int(row.get("announcements"))) is not None:
            line.append(f", {count} announcements")
        if (age := as_num(row.get("last_seen_s"))) is not None:
            line.append(f", last {age:.0f} s ago")
        grid.add_row("announced by", line)
    if (held := as_int(data.get("policy_held"))) is not None:
        grid.add_row("policy", step_text(held, data.get("max_steps"), None))
    if (since := as_num(data.get("since_s"))) is not None:
        grid.add_row("for", f"{since:.0f} s")
    if (switches := as_int(data.get("switches"))) is not None:
        grid.add_row("switches", str(switches))
    profile = as_dict(data.get("profile"))
    if profile:
        grid.add_row("hardware", _profile_text(profile))
    return Panel(grid, title="role")


def checkpoints_view(section: Any, rates: dict[str, str] | None = None) -> RenderableType:
    data = as_dict(section)
    table = Table(expand=True, title="checkpoints")
    for column in ("step", "state", "pieces", "availability (peers per piece)", "manifest"):
        table.add_column(column)
    versions = [as_dict(v) for v in as_list(data.get("versions"))[-MAX_VERSIONS:]]
    for version in versions:
        state = as_text(version.get("state"), 16) or "?"
        table.add_row(
            _number(version.get("step")),
            Text(state, style=_CHECKPOINT_STYLE.get(state, "")),
            f"{_number(version.get('have'))}/{_number(version.get('pieces'))}",
            availability_bar(version.get("availability")),
            Text(short(as_text(version.get("manifest_id"), 80), 6)),
        )
    footer = Text()
    if (error := _error(data)) is not None:
        footer.append(error)
        footer.append("  ")
    footer.append(f"peers {_number(data.get('peers'))}")
    for key, label in (("bytes_in", "checkpoint bytes in"), ("bytes_out", "checkpoint bytes out")):
        if (amount := as_num(data.get(key))) is not None:
            rate = (rates or {}).get(label, "")
            footer.append(f"  {key.replace('_', ' ')} {format_bytes(amount)}")
            footer.append(f" ({rate})" if rate.endswith("/s") else "")
    footer.append("   legend: · 0  ░ 1  ▒ 2  ▓ 3  █ 4+ peers", style="dim")
    return Group(table, footer) if versions else Panel(footer, title="checkpoints")


def _counter_view(title: str, section: Any, keys: tuple[str, ...], extra: tuple[str, ...] = ()) -> Panel:
    data = as_dict(section)
    grid = _grid()
    if (error := _error(data)) is not None:
        grid.add_row("error", error)
    for key in keys:
        grid.add_row(key.replace("_", " "), _number(data.get(key)))
    grid.add_row("rejected", _counts_text(counts(data.get("rejected"))))
    if device := as_text(data.get("device"), 32):
        grid.add_row("device", Text(device))
    if plan := as_text(data.get("vram_plan"), 480):
        grid.add_row("vram plan", Text(plan))
    for key in extra:
        grid.add_row(key.replace("_", " "), _number(data.get(key), 2))
    return Panel(grid, title=title)


ACCEPTED_IS_NOT_TRAINED = (
    "accepted: a trusted validator's verdict; the trainer trains the accepted batches that are still "
    "within its staleness bound when it takes them, so it may train fewer"
)


def rollouts_view(section: Any) -> Panel:
    panel = _counter_view("rollouts", section, ("produced", "published", "accepted"))
    grid = panel.renderable
    if isinstance(grid, Table):
        grid.add_row("", Text(ACCEPTED_IS_NOT_TRAINED, style="dim"))
    return panel


def validation_view(section: Any) -> Panel:
    return _counter_view("validation", section, ("validated", "accepted", "backlog"), ("mean_validate_s",))


def curve_text(points: list[tuple[float, float]], digits: int = 3) -> Text:
    if not points:
        return Text("-")
    values = [y for _, y in points]
    text = Text(sparkline(values), style="cyan")
    text.append(
        f"  last {values[-1]:.{digits}f} @ step {points[-1][0]:.0f}  (min {min(values):.{digits}f}, "
        f"max {max(values):.{digits}f})"
    )
    return text


def duration_text(seconds: float) -> str:
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def step_text(step: Any, max_steps: Any, steps_per_s: Any) -> Text:
    """``306/400 · ETA 12 min 30 s (0.13 steps/s)``, or ``400/400 · the run has ended``."""
    now, last, rate = as_int(step), as_int(max_steps), as_num(steps_per_s)
    if now is None:
        return Text("-")
    if last is None or last <= 0:
        return Text(str(now))
    text = Text(f"{now}/{last}")
    if now >= last:
        text.append(" · the run has ended", style="bold green")
    elif rate is not None and rate > 0:
        text.append(f" · ETA {duration_text((last - now) / rate)} ({rate:.2f} steps/s)")
    return text


def training_view(section: Any) -> Panel:
    data = as_dict(section)
    grid = _grid()
    if (error := _error(data)) is not None:
        grid.add_row("error", error)
    grid.add_row("step", step_text(data.get("step"), data.get("max_steps"), data.get("steps_per_s")))
    if device := as_text(data.get("device"), 32):
        grid.add_row("device", Text(device))
    grid.add_row("reward", curve_text(series(data.get("reward_curve"))))
    grid.add_row("held-out", curve_text(series(data.get("held_out"))))
    grid.add_row("batches accepted", _number(data.get("batches_accepted")))
    grid.add_row("batches rejected", _counts_text(counts(data.get("batches_rejected"))))
    grid.add_row("checkpoints shared", _number(data.get("checkpoints_shared")))
    workers = counts(data.get("accepted_by_worker"), limit=8)
    if workers:
        grid.add_row("top workers", Text(", ".join(f"{short(k, 6)}={v}" for k, v in workers.items())))
    return Panel(grid, title="training")


def generic_view(name: str, section: Any) -> Panel:
    """A section this TUI does not know: its scalar fields, bounded."""
    grid = _grid()
    data = as_dict(section)
    for key, value in list(data.items())[:MAX_ENTRIES]:
        grid.add_row(Text(as_text(key, 32)), Text(compact(value, 480)))
    if not data:
        grid.add_row("", Text("(no fields)", style="dim"))
    return Panel(grid, title=Text(as_text(name, 32)))


def other_sections_view(sections: dict[str, Any]) -> Panel:
    """Sections the TUI has no view for, one line each (their fields as values), so a node with many
    services still fits a terminal: the probe and reachability panels alone took ~22 rows."""
    grid = Table.grid(padding=(0, 2))
    names = [as_text(name, 24) for name in sections]
    grid.add_column(style="bold", no_wrap=True, min_width=max(map(len, names), default=1))
    grid.add_column(no_wrap=True, overflow="ellipsis")
    for name, section in sections.items():
        grid.add_row(Text(as_text(name, 24)), Text(compact(section, 480)))
    return Panel(grid, title="other sections")


def section_rates(current: Any, previous: Any, seconds: float) -> dict[str, str]:
    """Per-second deltas of section counters between two snapshots' ``sections``."""
    now, before = as_dict(current), as_dict(previous)
    rates: dict[str, str] = {}
    for label, name, key, unit in SECTION_RATES:
        value = as_num(as_dict(now.get(name)).get(key))
        if value is None:
            continue
        old = as_num(as_dict(before.get(name)).get(key))
        if old is None or seconds <= 0:
            rates[label] = format_bytes(value) if unit == "bytes" else f"{value:.0f} total"
            continue
        delta = (value - old) / seconds
        rates[label] = f"{format_bytes(delta)}/s" if unit == "bytes" else f"{delta:.2f}/s"
    return rates


def sections_view(sections: Any, rates: dict[str, str] | None = None) -> list[RenderableType]:
    """Every section present, known ones in a fixed order, the rest after them."""
    data = as_dict(sections)
    views: list[RenderableType] = []
    if "role" in data:
        views.append(role_view(data["role"]))
    if "checkpoints" in data:
        views.append(checkpoints_view(data["checkpoints"], rates))
    for name, view in (("rollouts", rollouts_view), ("validation", validation_view)):
        if name in data:
            views.append(view(data[name]))
    if "training" in data:
        views.append(training_view(data["training"]))
    others = {name: data[name] for name in list(data)[:MAX_ENTRIES] if name not in KNOWN}
    if others:
        views.append(other_sections_view(others))
    return views
