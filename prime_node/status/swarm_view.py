"""The whole swarm on one screen: one row per node's status snapshot, and the trainer's reward curve.

Used by ``prime-node demo``. Snapshots are the ``/status`` documents of each node (optionally with a
``"name"`` key added by the caller); like the single-node view it reads every value defensively, so a
node that answers oddly, or an ``{"error": ...}`` placeholder, is one odd row, not a crash.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from prime_node.status.sections import availability_bar, curve_text
from prime_node.status.values import as_dict, as_int, as_list, as_text, counts, series, short

MAX_ROWS = 128
BAR_CELLS = 24
_ROLE_STYLE = {"trainer": "bold magenta", "inferer": "cyan", "validator": "green", "seeder": "dim"}


def _rejected(section: dict[str, Any], key: str = "rejected") -> str:
    total = sum(counts(section.get(key)).values())
    return f" / {total} refused" if total else ""


def _n(section: dict[str, Any], key: str) -> int:
    return as_int(section.get(key)) or 0


def _work(sections: dict[str, Any]) -> Text:
    lines = []
    training = as_dict(sections.get("training"))
    if training:
        trained = _n(training, "batches_accepted")
        refused = _rejected(training, "batches_rejected")
        lines.append(f"step {_n(training, 'step')}: {trained} batches trained{refused}")
    rollouts = as_dict(sections.get("rollouts"))
    if rollouts:
        made, accepted = _n(rollouts, "produced"), _n(rollouts, "accepted")
        lines.append(f"rollouts {made} made, {accepted} ok{_rejected(rollouts)}")
    validation = as_dict(sections.get("validation"))
    if validation:
        checked, accepted = _n(validation, "validated"), _n(validation, "accepted")
        backlog = _n(validation, "backlog")
        lines.append(f"validated {checked}, {accepted} ok{_rejected(validation)}, backlog {backlog}")
    return Text("\n".join(lines) or "-")


def _checkpoint(sections: dict[str, Any]) -> Text:
    versions = [as_dict(v) for v in as_list(as_dict(sections.get("checkpoints")).get("versions"))]
    versions = [v for v in versions if as_int(v.get("step")) is not None]
    if not versions:
        return Text("-")
    newest = max(versions, key=lambda v: _n(v, "step"))
    state = as_text(newest.get("state"), 12)
    text = Text(f"v{_n(newest, 'step')} {_n(newest, 'have')}/{_n(newest, 'pieces')} {state}\n")
    text.append_text(availability_bar(newest.get("availability"), cells=BAR_CELLS))
    return text


def _row(snapshot: dict[str, Any]) -> list[Text]:
    sections = as_dict(snapshot.get("sections"))
    address = as_text(snapshot.get("address"), 42)
    name = as_text(snapshot.get("name"), 24) or short(address, 6) or "?"
    if not address and (error := as_text(snapshot.get("error"))):
        return [Text(name), Text("-"), Text("-"), Text("-"), Text(error, style="red")]
    role_section = as_dict(sections.get("role"))
    role = as_text(role_section.get("role"), 16) or as_text(snapshot.get("role"), 16) or "?"
    role_text = Text(role, style=_ROLE_STYLE.get(role, ""))
    if reason := as_text(role_section.get("reason"), 60):
        role_text.append("\n" + reason, style="dim")
    peers = as_int(snapshot.get("connected_peers"))
    return [
        Text(name),
        role_text,
        Text("-" if peers is None else str(peers)),
        _checkpoint(sections),
        _work(sections),
    ]


def render_swarm(snapshots: list[dict[str, Any]], *, title: str = "swarm") -> RenderableType:
    """One row per node (role and why, peers, newest checkpoint with piece availability, work counters),
    then the trainer's reward and held-out curves if a snapshot has them."""
    nodes = [as_dict(s) for s in as_list(snapshots)[:MAX_ROWS]]
    table = Table(title=f"{title} ({len(nodes)} nodes)", expand=True)
    for column in ("node", "role", "peers", "checkpoint", "work"):
        table.add_column(column)
    for snapshot in nodes:
        table.add_row(*_row(snapshot))
    parts: list[RenderableType] = [table]
    for snapshot in nodes:
        training = as_dict(as_dict(snapshot.get("sections")).get("training"))
        if training.get("reward_curve") is not None or training.get("held_out") is not None:
            curves = Table.grid(padding=(0, 2))
            curves.add_column(style="bold")
            curves.add_column()
            curves.add_row("reward", curve_text(series(training.get("reward_curve"))))
            curves.add_row("held-out", curve_text(series(training.get("held_out"))))
            parts.append(curves)
            break
    return Group(*parts)
