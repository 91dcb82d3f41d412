"""The trainer's signed demand: which policy steps it still accepts and how many batches it still wants.

Issue 38: inferers produced what they could, not what the trainer would take, and a third of all batches
went stale. The trainer now gossips a ``Demand`` (topic ``demand``) whenever its wants change (rate
limited) and every few seconds (a late joiner learns it): the step it trains, the ``floor`` (the lowest
policy step a batch arriving now can still be trained on: ``step - async_level``, raised by the batches
already queued in front of it), how many more batches it wants of each policy step from the floor up, and
its recent time per step, from which an inferer projects the floor at the time its batch would arrive,
and ``heard``: per worker, the newest batch counter of the batches the trainer has heard announced, so an
inferer counts as on its way only its own batches the demand cannot count yet (those above its mark).

Authority: only the run's trainer may speak for it (the run announcement names it, and a joiner pins it).
Anyone can sign a well-formed demand, so ``DemandBook`` believes only one signed by that trainer, for
this run, with a ``sequence`` above the last one it believed: a forged or replayed demand changes nothing.
Demand is advisory. It never admits a batch: the staleness bound, the verdicts and the trainer's own checks
decide that, so the worst a stale view can do is make an inferer produce a batch nobody wanted.

Pure: callers pass ``now_ms`` (wall, for the envelope) and ``now`` (monotonic seconds, for projection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from crypto.keys import Address, WalletKey
from protocol.codec import IntRange, MaxLen, Message, decode, encode, message
from protocol.envelope import Domain, Envelope, check_signature, seal
from protocol.errors import InvariantError, ProtocolError, RemoteProtocolError

DEMAND_KIND = "demand"
MAX_WANTED = 64
"""Policy steps one demand lists (a run's ``async_level`` + 1 of them; 64 is far beyond any we run)."""
MAX_WANT = 1024
"""Batches wanted of one policy step, at most."""
MAX_HEARD = 16
"""Workers one demand names in ``heard`` (the most recently heard first)."""
MAX_SKEW_MS = 30_000
MAX_STEP_MS = (1 << 31) - 1
_U63 = (1 << 63) - 1


@message("run.demand.heard", max_bytes=64)
@dataclass(frozen=True)
class Heard(Message):
    """The newest batch counter of ``worker``'s the trainer had heard announced when it made the demand."""

    worker: Address
    counter: Annotated[int, IntRange(0, _U63)]


@message("run.demand", max_bytes=1024)
@dataclass(frozen=True)
class Demand(Message):
    """What the trainer will still take (module doc)."""

    run_id: Annotated[str, MaxLen(64)]
    sequence: Annotated[int, IntRange(0, _U63)]
    """Strictly increasing per trainer (its wall clock in ms, bumped): a receiver keeps the highest."""
    step: Annotated[int, IntRange(0, _U63)]
    """The step the trainer trains next: its newest policy is ``step``."""
    floor: Annotated[int, IntRange(0, _U63)]
    """The lowest policy step a batch arriving now can still be trained on (at most ``step``)."""
    wanted: Annotated[tuple[Annotated[int, IntRange(0, MAX_WANT)], ...], MaxLen(MAX_WANTED)]
    """More batches wanted of policy steps ``floor``, ``floor + 1``, … (at most up to ``step``)."""
    step_ms: Annotated[int, IntRange(0, MAX_STEP_MS)]
    """The trainer's recent milliseconds per step (0: not measured yet)."""
    fresh: Annotated[int, IntRange(0, MAX_WANT)]
    """Batches wanted of each policy step above ``step`` (published after this demand)."""
    heard: Annotated[tuple[Heard, ...], MaxLen(MAX_HEARD)] = ()
    """Per worker, the newest batch counter the trainer had heard (at most one entry per worker): its
    batches up to it are counted in ``wanted`` already (as had), whatever their verdicts."""

    def __post_init__(self) -> None:
        if self.floor > self.step:
            raise InvariantError("a demand's floor is above its step", reason="bad_demand")
        if len(self.wanted) > self.step - self.floor + 1:
            raise InvariantError("a demand lists wants above its step", reason="bad_demand")
        if len({h.worker for h in self.heard}) != len(self.heard):
            raise InvariantError("a demand names a worker twice in heard", reason="bad_demand")

    def heard_of(self, worker: Address) -> int | None:
        """The newest batch counter of ``worker``'s this demand counts (None: none named)."""
        return next((h.counter for h in self.heard if h.worker == worker), None)

    def wants(self, policy_step: int) -> int:
        """More batches wanted of ``policy_step`` as of this demand (0 below the floor or unlisted,
        ``fresh`` above ``step``)."""
        if policy_step > self.step:
            return self.fresh
        index = policy_step - self.floor
        return self.wanted[index] if 0 <= index < len(self.wanted) else 0


def demand_domain(run_id: str) -> Domain:
    return Domain("demand", run_id)  # DEMAND_KIND (tests/protocol/test_protocol_doc.py reads the literal)


def seal_demand(key: WalletKey, demand: Demand, *, now_ms: int) -> Envelope:
    """Sign ``demand`` as the trainer ``key``."""
    return seal(key, demand_domain(demand.run_id), encode(demand), now_ms=now_ms)


def open_demand(envelope: Envelope, *, run_id: str, trainer: Address, now_ms: int) -> Demand:
    """The demand inside ``envelope`` if ``trainer`` signed it for ``run_id``; RemoteProtocolError
    otherwise (``wrong_domain``, a bad signature, ``untrusted_trainer``, ``wrong_run``,
    ``from_the_future``, or a malformed payload)."""
    if envelope.domain != str(demand_domain(run_id)):
        raise RemoteProtocolError(
            f"envelope for {envelope.domain[:80]!r}, not run {run_id}'s demand", reason="wrong_domain"
        )
    check_signature(envelope)
    if envelope.signer != trainer:
        raise RemoteProtocolError(
            f"demand signed by {envelope.signer}, the run's trainer is {trainer}", reason="untrusted_trainer"
        )
    if envelope.timestamp_ms > now_ms + MAX_SKEW_MS:
        raise RemoteProtocolError("demand is dated in the future", reason="from_the_future")
    demand = decode(envelope.payload, Demand)
    if demand.run_id != run_id:
        raise RemoteProtocolError("demand names another run than its envelope", reason="wrong_run")
    return demand


@dataclass(frozen=True)
class Start:
    """Whether an inferer should start a batch of its policy now, and why not."""

    go: bool
    reason: str
    """``no_demand`` (nothing heard: behave as without demand), ``wanted``, ``would_be_stale``,
    ``wants_met``."""


class DemandBook:
    """The newest demand believed from the run's trainer, and what it implies (module doc).

    ``offer`` takes an envelope frame from the network; it returns the demand when believed and raises
    ``ProtocolError`` otherwise (``replayed`` for a sequence not above the last believed one). A demand
    older than ``max_age_s`` counts as none heard (the trainer is gone or partitioned away)."""

    def __init__(self, run_id: str, trainer: Address, *, max_age_s: float = 30.0) -> None:
        self.run_id = run_id
        self.trainer = trainer
        self.max_age_s = max_age_s
        self.current: Demand | None = None
        self.heard_at = 0.0
        self.believed = 0
        self.refused: dict[str, int] = {}

    def offer(self, frame: bytes, *, now_ms: int, now: float) -> Demand:
        try:
            envelope = decode(frame, Envelope)
            demand = open_demand(envelope, run_id=self.run_id, trainer=self.trainer, now_ms=now_ms)
            if self.current is not None and demand.sequence <= self.current.sequence:
                raise RemoteProtocolError(
                    f"demand sequence {demand.sequence} is not above {self.current.sequence}",
                    reason="replayed",
                )
        except ProtocolError as exc:
            self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
            raise
        self.current = demand
        self.heard_at = now
        self.believed += 1
        return demand

    def live(self, now: float) -> Demand | None:
        """The believed demand unless it is older than ``max_age_s``."""
        if self.current is None or now - self.heard_at > self.max_age_s:
            return None
        return self.current

    def floor(self, now: float) -> int | None:
        """The floor as the trainer last published it (None: no live demand). Not projected: whoever
        drops batches below it must never drop one the trainer would still take."""
        demand = self.live(now)
        return None if demand is None else demand.floor

    def projected_floor(self, now: float, ahead_s: float) -> int | None:
        """The floor ``ahead_s`` seconds from now: one step higher per ``step_ms`` elapsed since the demand
        was heard, never above the demand's own ``step`` (so the newest policy is always worth a batch and a
        trainer that has stalled is not starved)."""
        demand = self.live(now)
        if demand is None:
            return None
        if demand.step_ms <= 0:
            return demand.floor
        elapsed = max(0.0, now - self.heard_at) + max(0.0, ahead_s)
        steps = int(elapsed * 1000 // demand.step_ms)
        return min(demand.step, demand.floor + steps)

    def should_start(
        self,
        policy_step: int,
        *,
        now: float,
        eta_s: float,
        in_flight: int,
        in_flight_total: int | None = None,
    ) -> Start:
        """Start a batch of ``policy_step`` that would reach the trainer in ``eta_s`` seconds, given
        ``in_flight`` batches of that step already on their way that this demand cannot count (the
        inferer's own above its ``heard`` mark) and ``in_flight_total`` of any step (None: not counted)?
        The wants of every step the batch could still be trained at fill one queue: a batch of another
        step on its way takes a place in it too."""
        demand = self.live(now)
        if demand is None:
            return Start(True, "no_demand")
        floor = self.projected_floor(now, eta_s)
        assert floor is not None
        if policy_step < floor:
            return Start(False, "would_be_stale")
        if demand.wants(policy_step) - in_flight <= 0:
            return Start(False, "wants_met")
        if in_flight_total is not None:
            total = sum(demand.wanted[max(0, floor - demand.floor) :])
            if policy_step > demand.step:
                total += demand.fresh
            if total - in_flight_total <= 0:
                return Start(False, "wants_met")
        return Start(True, "wanted")
