"""The demo's result, computed from the last status document of every node (pure: dicts in, dict out).

Only numbers the nodes themselves report are used: the trainer's "training" section is the authority on
steps, held-out accuracy and which worker's batches it accepted; the validators' "validation" sections
say why batches were refused; the adversary's own "rollouts" section says what it tried.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _section(snapshot: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    if not isinstance(snapshot, Mapping):
        return {}
    sections = snapshot.get("sections")
    value = sections.get(name) if isinstance(sections, Mapping) else None
    return dict(value) if isinstance(value, Mapping) and "error" not in value else {}


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _reasons(value: Any) -> dict[str, int]:
    if not isinstance(value, Mapping):
        return {}
    return {str(reason): _int(count) for reason, count in sorted(value.items()) if _int(count)}


def _add(total: dict[str, int], more: Mapping[str, int]) -> None:
    for reason, count in more.items():
        total[reason] = total.get(reason, 0) + count


def _points(value: Any) -> list[tuple[int, float]]:
    """``[[step, value], ...]`` from a status document, malformed entries skipped, sorted by step."""
    points = []
    for item in value if isinstance(value, list) else []:
        if (
            isinstance(item, list | tuple)
            and len(item) == 2
            and isinstance(item[0], int | float)
            and isinstance(item[1], int | float)
        ):
            points.append((int(item[0]), float(item[1])))
    return sorted(points)


def training_progress(trainer: Mapping[str, Any] | None) -> tuple[int, list[tuple[int, float]]]:
    """(steps done, held-out points) from the trainer's snapshot."""
    training = _section(trainer, "training")
    return _int(training.get("step")), _points(training.get("held_out"))


def finished(trainer: Mapping[str, Any] | None, steps: int) -> bool:
    """The trainer has done ``steps`` steps and evaluated the held-out set at (or after) the last one."""
    done, held_out = training_progress(trainer)
    return done >= steps and bool(held_out) and held_out[-1][0] >= steps


def summarize(
    snapshots: Mapping[str, Mapping[str, Any] | None],
    roles: Mapping[str, str],
    *,
    addresses: Mapping[str, str] | None = None,
    adversary_address: str | None = None,
    adversary_kind: str | None = None,
    wall_s: float | None = None,
    processes: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The summary printed at the end (``--json``: exactly this object).

    ``snapshots`` maps node name -> last status document (None if it never answered); ``roles`` maps node
    name -> trainer/validator/inferer/adversary; ``addresses`` maps node name -> wallet address (known
    up front, so a node that never answered is still named).
    """
    trainer_name = next((name for name, role in roles.items() if role == "trainer"), None)
    trainer = snapshots.get(trainer_name) if trainer_name is not None else None
    training = _section(trainer, "training")
    steps, held_out = training_progress(trainer)
    curve = _points(training.get("reward_curve"))
    accepted_by_worker = {
        address.lower(): count for address, count in _reasons(training.get("accepted_by_worker")).items()
    }
    validation_rejected: dict[str, int] = {}
    validated = 0
    nodes: dict[str, Any] = {}
    for name, snapshot in snapshots.items():
        validation = _section(snapshot, "validation")
        rollouts = _section(snapshot, "rollouts")
        checkpoints = _section(snapshot, "checkpoints")
        _add(validation_rejected, _reasons(validation.get("rejected")))
        validated += _int(validation.get("validated"))
        entry: dict[str, Any] = {
            "role": roles.get(name, "?"),
            "address": (addresses or {}).get(name)
            or (snapshot.get("address") if isinstance(snapshot, Mapping) else None),
            "answered": isinstance(snapshot, Mapping),
            "connected_peers": _int(snapshot.get("connected_peers")) if isinstance(snapshot, Mapping) else 0,
        }
        if rollouts:
            entry["rollouts"] = {
                "produced": _int(rollouts.get("produced")),
                "published": _int(rollouts.get("published")),
                "accepted": _int(rollouts.get("accepted")),
                "rejected": _reasons(rollouts.get("rejected")),
            }
        if validation:
            entry["validation"] = {
                "validated": _int(validation.get("validated")),
                "accepted": _int(validation.get("accepted")),
                "rejected": _reasons(validation.get("rejected")),
            }
        if checkpoints:
            entry["checkpoint_bytes_in"] = _int(checkpoints.get("bytes_in"))
            entry["checkpoint_bytes_out"] = _int(checkpoints.get("bytes_out"))
        nodes[name] = entry
    summary: dict[str, Any] = {
        "reward_start": held_out[0][1] if held_out else None,
        "reward_end": held_out[-1][1] if held_out else None,
        "held_out": [list(point) for point in held_out],
        "steps": steps,
        "checkpoints_shared": _int(training.get("checkpoints_shared")),
        "batches_accepted": _int(training.get("batches_accepted")),
        "batches_rejected": _reasons(training.get("batches_rejected")),
        "batches_validated": validated,
        "validation_rejected": validation_rejected,
        "train_reward_first": curve[0][1] if curve else None,
        "train_reward_last": curve[-1][1] if curve else None,
    }
    if adversary_address is not None:
        adversary_name = next((name for name, role in roles.items() if role == "adversary"), None)
        own = nodes.get(adversary_name, {}).get("rollouts", {}) if adversary_name else {}
        summary["adversary"] = {
            "kind": adversary_kind,
            "address": adversary_address,
            "published": own.get("published", 0),
            "rejected": own.get("rejected", {}),
        }
        summary["adversary_accepted"] = accepted_by_worker.get(adversary_address.lower(), 0)
    else:
        summary["adversary"] = None
        summary["adversary_accepted"] = 0
    summary["accepted_by_worker"] = {
        name: accepted_by_worker.get(str(entry["address"]).lower(), 0)
        for name, entry in nodes.items()
        if entry["role"] in ("inferer", "adversary") and entry["address"]
    }
    # Issue 38: how much of all inference went stale, and how busy the trainer was.
    produced = sum(
        int(entry.get("rollouts", {}).get("produced", 0))
        for entry in nodes.values()
        if entry["role"] in ("inferer", "adversary")
    )
    refused = summary["batches_rejected"]
    stale = refused.get("stale", 0) + refused.get("stale_in_queue", 0)
    summary["batches_produced"] = produced
    summary["stale_share"] = round(stale / produced, 4) if produced else None
    busy = training.get("busy_share")
    summary["busy_share"] = busy if isinstance(busy, int | float) else None
    if wall_s is not None:
        summary["wall_s"] = round(wall_s, 1)
    summary["processes"] = list(processes)
    summary["nodes"] = nodes
    return summary
