"""What the trainer wants of the network (issue 38), pure rules and the counts they read; the demand
message and its rules are protocol/demand.py, its gossip roles/demand.py.

``plan_demand`` turns the trainer's queue into what it still wants, ``demand_depth`` chooses how deep that
queue may be from the batches' measured round trip, and ``TrainerWants`` keeps the counts they plan from
(batches trained and being admitted per policy, recent arrival ages and round trips, the time per step;
the batches its admission heard announced and not yet judged come from a ``HeardSource``, and the demand
names, per worker, the newest batch counter heard, so each inferer counts only its own batches the
demand cannot count yet: the count of batches on their way is exact).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from crypto.keys import Address
from protocol.demand import MAX_HEARD, MAX_WANT, MAX_WANTED, Heard

DEMAND_DEPTH = 2
"""Steps' worth of batches the trainer wants on their way and queued before any has arrived;
``demand_depth`` then follows the measured round trip."""
ARRIVAL_WINDOW = 16
"""Recent batches whose age on arrival ``demand_depth`` reads."""
AT_BOUND_SHARE = 8
"""``demand_depth`` goes one step shallower when more than one in this many recent batches were trained
at the staleness bound (or dropped past it)."""
STEP_MS_WEIGHT = 0.2
"""Weight of the newest step in the demand's ``step_ms`` and the trainer's ``train_s`` (exponential means)."""


def plan_demand(
    *,
    step: int,
    async_level: int,
    have: Mapping[int, int],
    queued_steps: int,
    per_policy: int = 1,
    depth: int = DEMAND_DEPTH,
    coming: Mapping[int, int] | None = None,
    shared: int | None = None,
) -> tuple[int, tuple[int, ...], int]:
    """The floor, the wants and the fresh wants of a trainer about to train ``step`` (pure).

    ``have``: batches per policy step trained, queued or being admitted; ``queued_steps``: steps' worth of
    batches queued in front of a batch arriving now (the trainer takes the oldest policy first). Such a
    batch is trained ``queued_steps`` steps from now, so it must be of policy ``step + queued_steps -
    async_level`` or newer (never above ``step``, the newest policy there is). Each policy step is wanted
    ``per_policy`` times (one step's worth: what the trainer consumes per step), less what it has of it,
    and all wants together fill the queue to ``depth`` steps' worth at most, newest policies first: a
    batch beyond that would only wait in the queue while newer ones are made, and go stale there
    (measured: 307 of 681 batches, issue 38). ``fresh`` (wants of each policy newer than ``step``) shares
    that room. ``step`` may be trained and not shared yet (the trainer shares a policy while it trains
    the next): its wants hold its place in the queue, and no inferer can start it before it is shared.
    ``coming``: batches per policy step heard announced and not yet judged: had, and those at or above
    the floor take room in the queue, but they do not raise the floor (a validator may still reject
    them, and the floor must never refuse a batch the trainer would take). Room left once every policy
    is had goes to the newest policy an inferer can hold: ``shared`` (the newest shared; None: ``step``).
    """
    floor = max(0, min(step, step + queued_steps - async_level))
    top = min(step, floor + MAX_WANTED - 1)
    # Only batches the trainer could take count: one claiming a policy it has not made yet (a flood of
    # future-step frames, never judged) would otherwise fill the room and starve it.
    coming = {p: n for p, n in (coming or {}).items() if floor <= p <= step}
    have = {p: have.get(p, 0) + coming.get(p, 0) for p in set(have) | set(coming)}
    # Heard batches may be a hostile key's that never come (each counted up to 20 s): they never take the
    # last step's worth of room, so the trainer always wants something (a flood cannot starve it).
    room = max(0, depth - queued_steps - min(sum(coming.values()), depth - 1))
    fresh = min(per_policy, room, MAX_WANT)
    wanted = [0] * (top - floor + 1)
    for policy in range(top, floor - 1, -1):
        take = min(room, MAX_WANT, max(0, per_policy - have.get(policy, 0)))
        wanted[policy - floor] = take
        room -= take
    # Room left with every policy had (a lone inferer: its batch arrived, is trained, and the next policy
    # is not out yet) goes to the newest policy an inferer can hold: the trainer takes a batch per step,
    # not per policy, and a second batch of it is trained a step later, still the freshest. Without it,
    # one inferer makes each batch only after the last one is trained and the next policy is out (busy
    # share 0.15, issue 38). Here every heard batch counts (no room kept back), so these wants stop as
    # soon as the room is honestly filled.
    spare = depth - queued_steps - sum(coming.values()) - sum(wanted)
    newest = step if shared is None else max(floor, min(step, shared))
    if spare > 0 and newest <= top:
        wanted[newest - floor] = min(MAX_WANT, wanted[newest - floor] + spare)
    return floor, tuple(wanted), fresh


def demand_depth(
    arrival_ages: Sequence[int],
    async_level: int,
    *,
    trained_ages: Sequence[int] = (),
    round_trips: Sequence[int] = (),
    most: int | None = None,
) -> int:
    """Steps' worth of batches the trainer wants on their way (heard, not yet judged), being admitted
    and queued, from the ages of recent batches on arrival and when trained (pure).

    A batch's age on arrival (the trainer's step when it is queued minus its policy step) is its round trip in
    steps: policy shared, fetched, generated, validated, admitted. To never wait, the trainer needs about that
    many batches on their way plus the one it trains next (Little's law: the late age + 1, the late age being
    the upper quartile of ``arrival_ages``). But an age counts only the steps the trainer took meanwhile:
    while it waits for batches they arrive young, and the age says one on the way is enough, a trap that keeps
    itself true (a lone inferer: busy share 0.15, issue 38). So Little's law reads ``round_trips`` where they
    say more: the same batches' round trips in the trainer's busy steps (seconds from their policy's making to
    their arrival ÷ the seconds of a ``train``), the age a trainer that never waited would see. The bound
    reads the age. A batch waits behind the queue (the oldest policy is trained first) and is dropped
    ``stale_in_queue`` past ``async_level``: arriving that late behind ``depth - 1`` others it is trained at
    ``late + depth - 1``, so the depth is at most ``async_level - late + 1``. And when more than one in
    ``AT_BOUND_SHARE`` of ``trained_ages`` (the latest batches' ages when trained) were at the bound, one step
    less: a batch trained at the bound is one late arrival away from being dropped. Measured (issue 38, seed
    1, ``swarm_learning.py``): counted exactly, a fixed depth of 2 trained 14 % at the bound, dropped 0.3 %
    and kept the trainer busy 0.71 of the time; a fixed depth of 3 trained 33 % at the bound, dropped 8 %,
    busy 0.86; this rule with one in 5 dropped 4.2 % (5.3 % in the demo), one in 8 dropped 2.7 % in the demo,
    busy 0.80. Never below 1 (a trainer that wants nothing starves) nor above ``most`` (default ``async_level
    - 1``); ``DEMAND_DEPTH`` (within those) while nothing has arrived."""
    cap = max(1, async_level - 1 if most is None else most)
    if not arrival_ages:
        return min(cap, DEMAND_DEPTH)
    late = upper_quartile(arrival_ages)
    trip = max(late, upper_quartile(round_trips)) if round_trips else late
    depth = min(cap, trip + 1, async_level - late + 1)
    if AT_BOUND_SHARE * sum(age >= async_level for age in trained_ages) > len(trained_ages):
        depth -= 1
    return max(1, depth)


def upper_quartile(values: Sequence[int]) -> int:
    """The value three quarters of the way up ``values`` (one of them; ``values`` not empty)."""
    ordered = sorted(values)
    return ordered[(3 * len(ordered)) // 4]


class TrainerWants:
    """The trainer's side of the counts ``plan_demand`` takes, beside its queue (``StepGatherer``):
    batches trained per recent policy step, batches being admitted, the recent time per step, and the
    ages of recent batches on arrival (the queue's depth, ``demand_depth``)."""

    def __init__(
        self,
        async_level: int,
        *,
        heard: HeardSource | None = None,
        shared: Callable[[], int | None] | None = None,
    ) -> None:
        self.async_level = async_level
        self.source = heard
        """What admission heard announced and has not judged yet (None: counted as nothing)."""
        self.shared = shared
        """The newest policy step shared (the room left is wanted of it; None: the newest made)."""
        self.trained: Counter[int] = Counter()
        """Batches trained per policy step (the recent ones; the demand counts them as had)."""
        self.admitting: Counter[int] = Counter()
        """Batches being admitted per policy step (had, while they wait for admission)."""
        self.step_ms = 0.0
        self._last_step_at: float | None = None
        self.train_s = 0.0
        """Recent seconds of one step's ``train`` (an exponential mean): a busy step."""
        self._training_since: float | None = None
        self._made_at: dict[int, float] = {}
        """When each recent policy step was made (its step ended)."""
        self.arrival_ages: deque[int] = deque(maxlen=ARRIVAL_WINDOW)
        """Ages (trainer step - policy step) of the latest batches on arrival, stale ones included."""
        self.round_trips: deque[int] = deque(maxlen=ARRIVAL_WINDOW)
        """The same batches' round trips in busy steps, where their policy's making was seen."""
        self.trained_ages: deque[int] = deque(maxlen=ARRIVAL_WINDOW)
        """Ages (trainer step - policy step) of the latest batches when trained."""
        self.ages: dict[str, Counter[int]] = {
            "arrival": Counter(),
            "trained": Counter(),
            "stale": Counter(),
            "queued": Counter(),
            "trip": Counter(),
        }
        """Batches by age: on arrival, when trained, and on arrival for those later dropped
        ``stale_in_queue`` (the status shows where staleness comes from: a long round trip or the queue);
        steps by the batches queued when they began (``queued``); and batches by round trip in busy
        steps (``trip``)."""

    def arrived(self, step: int, policy: int, now: float | None = None) -> None:
        """A batch of ``policy`` reached the trainer at its step ``step``, at ``now`` (``demand_depth``
        reads its age, and its round trip when the policy's making was seen)."""
        age = max(0, min(step - policy, self.async_level + 1))  # past the bound is past it (bounded keys)
        self.arrival_ages.append(age)
        self.ages["arrival"][age] += 1
        made_at = self._made_at.get(policy)
        if made_at is not None and now is not None and self.train_s > 0:
            trip = max(0, min(int((now - made_at) / self.train_s), self.async_level + 1))
            self.round_trips.append(trip)
            self.ages["trip"][trip] += 1

    def train(self, step: int, policies: Sequence[int], queued: int, now: float | None = None) -> None:
        """Step ``step`` trains batches of ``policies`` (had, for the demand) from ``now``; ``queued``
        were left."""
        self._training_since = now
        for policy in policies:
            self.trained[policy] += 1
            self.ages["trained"][step - policy] += 1
            self.trained_ages.append(step - policy)
        self.ages["queued"][queued] += 1

    def dropped(self, batches: Sequence[tuple[int, int]]) -> None:
        """Queued batches (trainer step on arrival, policy step) dropped ``stale_in_queue``."""
        for arrived_step, policy in batches:
            self.ages["stale"][arrived_step - policy] += 1
            self.trained_ages.append(self.async_level + 1)  # past the bound: the queue is too deep

    def ages_status(self) -> dict[str, dict[int, int]]:
        return {name: dict(sorted(ages.items())) for name, ages in self.ages.items()}

    def depth(self) -> int:
        """Steps' worth of batches wanted queued now (``demand_depth``)."""
        return demand_depth(
            self.arrival_ages,
            self.async_level,
            trained_ages=self.trained_ages,
            round_trips=self.round_trips,
        )

    def admit_ended(self, policy: int) -> None:
        self.admitting[policy] -= 1
        if self.admitting[policy] <= 0:
            del self.admitting[policy]

    def stepped(self, step: int, now: float) -> None:
        """Step ``step`` ended at ``now`` (policy ``step`` made): its interval into ``step_ms``, its
        ``train`` time into ``train_s``, old policies out of ``trained``."""
        if self._training_since is not None:
            self.train_s = _step_mean(self.train_s, now - self._training_since)
            self._training_since = None
        self._made_at[step] = now
        for policy in [p for p in self._made_at if p < step - self.async_level - 1]:
            del self._made_at[policy]
        if self._last_step_at is not None:
            self.step_ms = _step_mean(self.step_ms, (now - self._last_step_at) * 1000)
        self._last_step_at = now
        for policy in [p for p in self.trained if p < step - self.async_level]:
            del self.trained[policy]

    def current(
        self,
        *,
        step: int,
        queued: Mapping[int, int],
        queued_steps: int,
        coming: Mapping[int, int] | None = None,
    ) -> tuple[int, int, tuple[int, ...], int, int]:
        """(step, floor, wanted, step_ms, fresh) for ``DemandPublisher``: ``queued`` batches per policy
        and ``queued_steps`` steps' worth in the trainer's queue, ``coming`` per policy heard announced
        and not yet judged (default: the ``HeardSource``'s)."""
        if coming is None and self.source is not None:
            coming = self.source.pending_by_policy()
        have = self.trained + Counter(queued) + self.admitting
        floor, wanted, fresh = plan_demand(
            step=step,
            async_level=self.async_level,
            have=have,
            queued_steps=queued_steps + sum(self.admitting.values()),
            depth=self.depth(),
            coming=coming,
            shared=None if self.shared is None else self.shared(),
        )
        return step, floor, wanted, round(self.step_ms), fresh

    def heard(self) -> tuple[Heard, ...]:
        """The demand's ``heard``: the most recently heard workers' newest batch counters."""
        if self.source is None:
            return ()
        return tuple(Heard(w, c) for w, c in self.source.heard_marks(MAX_HEARD))


def _step_mean(mean: float, value: float) -> float:
    """An exponential mean over steps (``STEP_MS_WEIGHT``) that starts at its first value."""
    return value if mean <= 0 else (1 - STEP_MS_WEIGHT) * mean + STEP_MS_WEIGHT * value


class HeardSource(Protocol):
    """What the trainer's admission heard announced (``AdmissionService``; verification/inbox/pending.py)."""

    on_change: Callable[[], None] | None

    def pending_by_policy(self) -> dict[int, int]: ...

    def heard_marks(self, most: int) -> tuple[tuple[Address, int], ...]: ...


def heard_source(admission: object, changed: Callable[[], None]) -> HeardSource | None:
    """``admission`` as a ``HeardSource`` calling ``changed`` on news, if it is one (a test's may not)."""
    if not all(hasattr(admission, name) for name in ("on_change", "pending_by_policy", "heard_marks")):
        return None
    source: HeardSource = admission  # type: ignore[assignment]
    source.on_change = changed
    return source
