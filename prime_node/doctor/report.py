"""The doctor's result: one ``Check`` per question, rendered as text lines or one JSON object.

A check passes, warns (worth knowing, not fatal), fails (the node will not work well: fix it) or is
skipped (it needs something not given, e.g. ``--bootstrap``). Every failure and skip carries one fix line;
the command exits non-zero when any check failed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final, Literal

Status = Literal["pass", "warn", "fail", "skip"]
PASS: Final = "pass"
WARN: Final = "warn"
FAIL: Final = "fail"
SKIP: Final = "skip"
_LABEL = {PASS: "ok  ", WARN: "warn", FAIL: "FAIL", SKIP: "skip"}


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    value: str
    """What was found, in one line a person can read."""
    fix: str | None = None
    """One line: what to do about a failure or warning (or how to run a skipped check)."""
    details: dict[str, Any] = field(default_factory=dict)
    """Machine-readable facts behind ``value`` (numbers for scripts), JSON-ready."""

    def __post_init__(self) -> None:
        if self.status in (FAIL, SKIP) and not self.fix:
            raise ValueError(f"check {self.name}: a {self.status} needs a fix line")

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "value": self.value, "fix": self.fix, **self.details}


@dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]
    elapsed_s: float = 0.0

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": not self.failed,
            "failed": [c.name for c in self.failed],
            "elapsed_s": round(self.elapsed_s, 2),
            "checks": {c.name: c.to_json() for c in self.checks},
        }

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def lines(self) -> list[str]:
        """Text for a terminal: one line per check, an indented ``fix:`` line under each that has one."""
        width = max((len(c.name) for c in self.checks), default=0)
        out = []
        for check in self.checks:
            out.append(f"{_LABEL[check.status]}  {check.name:<{width}}  {check.value}")
            if check.fix and check.status != PASS:
                out.append(f"      {'':<{width}}  fix: {check.fix}")
        summary = (
            f"{len(self.failed)} check(s) failed: {', '.join(c.name for c in self.failed)}"
            if self.failed
            else "all checks passed"
            + (" (see the warnings above)" if any(c.status == WARN for c in self.checks) else "")
        )
        out.append(f"{summary} in {self.elapsed_s:.1f} s")
        return out
