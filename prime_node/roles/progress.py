"""What a contributor's terminal says while ``join`` runs: a line when there is news, and a summary when
the node stops.

A home inferer used to print "following trainer …" and then nothing for hours (issue 36): no word of
rollouts produced, accepted or refused, of the policy it holds, or of the run ending. The habit of the
peers' tools is a BitTorrent client's one-line status and Psyche's TUI: role, what this node holds, what
it contributed and what came of it. The counts are the role service's own (``rollouts`` and
``validation`` status sections) and the weight swarm's; formatting is pure so it is tested on any input.

"Accepted" is a trusted validator's verdict. The trainer trains on accepted batches that are still fresh
(within ``async_level`` policies when it takes them), so accepted is not trained on; no peer is told what
the trainer took, and the lines say so in the summary rather than claim it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import trio

PROGRESS_INTERVAL_S = 60.0
"""A line at most this often while something changed, and whenever the role or the run's state does."""
SAMPLE_S = 1.0


@dataclass(frozen=True)
class Progress:
    """One look at a joined node: its role, the newest policy it holds, what it contributed."""

    role: str
    policy_held: int | None = None
    """The newest complete checkpoint this node holds (None before the first)."""
    max_steps: int | None = None
    """The run's last policy step, from its config (None before the run is known)."""
    published: int = 0
    """Rollout batches this node generated and published (inferer)."""
    accepted: int = 0
    """Of those, accepted by a trusted validator."""
    rejected: Mapping[str, int] = field(default_factory=dict)
    """Of those, rejected: count per reason."""
    validated: int = 0
    """Batches this node judged (validator)."""
    bytes_served: int = 0
    """Checkpoint bytes this node sent to peers."""

    @property
    def run_ended(self) -> bool:
        """The trainer published the run's last policy and this node holds it."""
        held, last = self.policy_held, self.max_steps
        return last is not None and held is not None and held >= last

    def news_since(self, before: Progress | None) -> bool:
        """Anything a contributor would want a line for: any count, the policy or the role changed."""
        return before is None or self != before


def progress_role(role: str | None, pinned: str | None) -> str:
    """The role a progress line names: the one running, else what the node is starting as. Before its
    first role a node only seeds, but a ``--role validator`` node's lines said "seeder" until then."""
    if role is not None:
        return role
    return f"{pinned} (starting)" if pinned is not None else "joining"


def _bytes(count: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _rejected(rejected: Mapping[str, int]) -> str:
    total = sum(rejected.values())
    if not total:
        return "0 rejected"
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(rejected.items(), key=lambda kv: -kv[1]))
    return f"{total} rejected ({reasons})"


def _policy(progress: Progress) -> str:
    if progress.policy_held is None:
        return "no policy yet"
    of = f"/{progress.max_steps}" if progress.max_steps is not None else ""
    return f"policy {progress.policy_held}{of}"


def _work(progress: Progress) -> str:
    if progress.role == "inferer" or progress.published:
        return (
            f"rollouts: {progress.published} published, {progress.accepted} accepted, "
            f"{_rejected(progress.rejected)}"
        )
    if progress.role == "validator" or progress.validated:
        return f"{progress.validated} batches judged"
    return ""


def progress_line(progress: Progress) -> str:
    """``inferer · policy 12/400 · rollouts: 48 published, 40 accepted, 3 rejected (stale_policy 3) · 1.2 GB
    served``; ends with the run's end once the last policy is held."""
    parts = [progress.role, _policy(progress), _work(progress), f"{_bytes(progress.bytes_served)} served"]
    line = " · ".join(part for part in parts if part)
    if progress.run_ended:
        line += f" · the run has ended (policy {progress.max_steps} published)"
    return line


def _duration(seconds: float) -> str:
    whole = max(0, int(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def summary_line(first: Progress | None, last: Progress, seconds: float) -> str:
    """What the node did in this session, for the line printed when it stops."""
    if last.policy_held is None:
        held = "no policy received"
    elif first is not None and first.policy_held is not None and first.policy_held != last.policy_held:
        held = f"policies {first.policy_held}–{last.policy_held} received"
    else:
        held = f"{_policy(last)} held"
    parts = [f"stopped after {_duration(seconds)} as {last.role}", held]
    if last.published:
        parts.append(
            f"{last.published} rollout batches published, {last.accepted} accepted by validators "
            f"(the trainer takes those still within its staleness bound), {_rejected(last.rejected)}"
        )
    if last.validated:
        parts.append(f"{last.validated} batches judged")
    parts.append(f"{_bytes(last.bytes_served)} of checkpoints served")
    if last.run_ended:
        parts.append("the run had ended")
    return "; ".join(parts)


def progress_json(progress: Progress, *, event: str = "progress") -> str:
    """The same facts as one JSON object (``join --json``)."""
    fields: dict[str, Any] = asdict(progress)
    fields["rejected"] = dict(progress.rejected)
    return json.dumps({"event": event, **fields, "run_ended": progress.run_ended}, sort_keys=True)


class ProgressReporter:
    """Samples ``sample`` every second; says a line when there is news, at most every ``interval_s``
    (sooner when the role changes or the run ends), and the summary when cancelled (the node stopping)."""

    def __init__(
        self,
        sample: Callable[[], Progress | None],
        say: Callable[[str], None],
        *,
        interval_s: float = PROGRESS_INTERVAL_S,
        as_json: bool = False,
    ) -> None:
        self.sample = sample
        self.say = say
        self.interval_s = interval_s
        self.as_json = as_json
        self.lines = 0

    def _emit(self, progress: Progress, event: str = "progress") -> None:
        self.lines += 1
        self.say(progress_json(progress, event=event) if self.as_json else progress_line(progress))

    async def run(self) -> None:
        started = trio.current_time()
        first: Progress | None = None
        said: Progress | None = None
        said_at = -float("inf")
        latest: Progress | None = None
        try:
            while True:
                await trio.sleep(SAMPLE_S)
                latest = self.sample()
                if latest is None:
                    continue
                if first is None or first.policy_held is None:
                    first = latest
                now = trio.current_time()
                urgent = said is None or latest.role != said.role or latest.run_ended != said.run_ended
                if latest.news_since(said) and (urgent or now - said_at >= self.interval_s):
                    self._emit(latest)
                    said, said_at = latest, now
        finally:
            if latest is not None:
                seconds = trio.current_time() - started
                if self.as_json:
                    self.lines += 1
                    self.say(progress_json(latest, event="summary"))
                else:
                    self.lines += 1
                    self.say(summary_line(first, latest, seconds))
