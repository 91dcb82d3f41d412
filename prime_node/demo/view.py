"""The live picture of the demo: a headline of the training run over the status package's swarm table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from prime_node.demo.summary import training_progress
from prime_node.status.swarm_view import render_swarm


def headline(trainer: Mapping[str, Any] | None, steps: int, elapsed_s: float, adversary: str | None) -> Text:
    done, held_out = training_progress(trainer)
    text = Text(f"prime-node demo  {elapsed_s:.0f} s  step {done}/{steps}", style="bold")
    if held_out:
        text.append(f"  held-out accuracy {held_out[0][1]:.2f} -> {held_out[-1][1]:.2f}")
    if adversary:
        text.append(f"  adversary: {adversary}", style="red")
    return text


def named_snapshots(
    snapshots: Mapping[str, Mapping[str, Any] | None], roles: Mapping[str, str]
) -> list[dict[str, Any]]:
    """One document per node, named for the table; a node that has not answered yet is a placeholder."""
    rows = []
    for name, snapshot in snapshots.items():
        label = f"{name} (cheats)" if roles.get(name) == "adversary" else name
        if isinstance(snapshot, Mapping):
            rows.append({**snapshot, "name": label})
        else:
            rows.append({"name": label, "role": "starting…"})  # not an error: it has not answered yet
    return rows


def render(
    snapshots: Mapping[str, Mapping[str, Any] | None],
    roles: Mapping[str, str],
    *,
    steps: int,
    elapsed_s: float,
    adversary: str | None = None,
) -> RenderableType:

    trainer_name = next((name for name, role in roles.items() if role == "trainer"), "")
    top = headline(snapshots.get(trainer_name), steps, elapsed_s, adversary)
    return Group(top, render_swarm(named_snapshots(snapshots, roles), title="local swarm"))
