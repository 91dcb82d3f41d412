"""How a peer obtains a full version it was given a delta for: the delta chain as a sans-IO planner.

A delta names the full version it applies to (``base``) and the one it produces (``target``). To hold a
target a peer rebuilds it from a full version it holds, through a chain of up to ``MAX_CHAIN`` known
deltas walked back from the target; when no chain reaches one, or a link does not rebuild its target,
it fetches the target whole (docs/weight-swarm.md, "Deltas"). Several obtains run at once (a followed
step, a ``fetch`` of a delta id), and each full version is obtained by one of them at a time: an obtain
*claims* the versions it builds (the builds in flight), and one that needs a version another claimed
waits for that build to end and plans again.

``Build.next`` walks the chain from what the world holds now (``ChainView``: the full versions held, the
versions being fetched, the deltas known) and the builds in flight, claims what it will build and says
what to do next: ``Have`` (the target is held or on its way: use it), ``WaitFor`` (another build of a
version the chain needs: wait for it to end, then ask again), ``Rebuild`` (apply these deltas in order,
from a base held or being fetched) or ``FetchWhole``. The caller reports ``built`` per link, ``abandon``
when a link fails (then it fetches whole) and ``close`` at the end, and does all the waiting and I/O.

Three rules keep it safe, whatever deltas a trainer signed (tests/protocol/test_rebuild_planner.py):

- **No wait cycle**: a link only waits for a version being fetched (a fetch waits for no build) or for a
  build whose delta is of an earlier step than its own, and a chain's steps strictly decrease from the
  target, so waits only ever go to earlier steps (two deltas signed in a circle fetch whole instead).
- **Chain length**: a build claims at most ``max_chain`` links; a longer chain is fetched whole.
- **A whole fetch is always reachable**: an obtain that cannot rebuild ends in ``FetchWhole`` (it never
  just gives up), and one that waits waits for a fetch or a build that ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from protocol.errors import LocalProtocolError

MAX_CHAIN = 8
"""Deltas a peer applies in a row to reach a version from a full version it holds."""


class Delta(Protocol):
    """A delta as the planner sees it (a delta ``Manifest`` is one)."""

    @property
    def step(self) -> int: ...
    @property
    def base(self) -> bytes: ...
    @property
    def target(self) -> bytes: ...


D = TypeVar("D", bound=Delta)
D_co = TypeVar("D_co", bound=Delta, covariant=True)


class ChainView(Protocol[D_co]):
    """What the node holds and knows, read at each ``Build.next``."""

    def held_step(self, mid: bytes) -> int | None:
        """The step of ``mid`` if it is a full version held complete."""

    def under_way_step(self, mid: bytes) -> int | None:
        """The step of ``mid`` if it is held otherwise (being fetched): its outcome is near."""

    def delta_to(self, target: bytes) -> D_co | None:
        """A known delta producing ``target`` (any choice is safe; one whose base is held is cheapest)."""


@dataclass(frozen=True)
class Have:
    """The target is held or being fetched (and this obtain claimed nothing): use its outcome."""

    target: bytes


@dataclass(frozen=True)
class WaitFor:
    """Another obtain builds ``mid``: wait until a build ends, then call ``next`` again."""

    mid: bytes


@dataclass(frozen=True)
class Rebuild(Generic[D]):
    """Apply ``links`` in order to ``base`` (held complete, or being fetched: wait for it first); each
    rebuilds the next one's base, the last rebuilds the target. Report ``built`` after each."""

    base: bytes
    links: tuple[D, ...]


@dataclass(frozen=True)
class FetchWhole:
    """No chain leads to the target (or a link failed): fetch it whole; it stays claimed until ``close``."""

    target: bytes


Plan = Have | WaitFor | Rebuild[D] | FetchWhole


class RebuildPlanner(Generic[D]):
    """The builds in flight on one node: ``building`` maps each full version claimed to the step of the
    delta its build goes through (None: fetched whole, or no delta chosen yet)."""

    def __init__(self, view: ChainView[D], *, max_chain: int = MAX_CHAIN) -> None:
        if max_chain < 1:
            raise LocalProtocolError("max_chain must be at least 1", reason="bad_config")
        self.view = view
        self.max_chain = max_chain
        self.building: dict[bytes, int | None] = {}

    def in_flight(self, target: bytes) -> bool:
        return target in self.building

    def obtain(self, target: bytes, via: D | None = None) -> Build[D]:
        """An obtain of ``target`` (through ``via`` first, if given); it claims the target at its first
        ``next`` unless that finds it held, being fetched or being built."""
        return Build(self, target, via, claimed=False)

    def claim(self, target: bytes, via: D) -> Build[D]:
        """An obtain of ``target`` through ``via`` that claims the target now (its work starts later)."""
        if target in self.building:
            raise LocalProtocolError("that version is being built already", reason="in_flight")
        self.building[target] = via.step
        return Build(self, target, via, claimed=True)


class Build(Generic[D]):
    """One obtain of ``target``: the links it claimed (``chain``, the target's delta first)."""

    def __init__(self, planner: RebuildPlanner[D], target: bytes, via: D | None, *, claimed: bool) -> None:
        self.planner = planner
        self.target = target
        self.via = via
        self.chain: list[D] = []
        self.claims: set[bytes] = {target} if claimed else set()
        """The versions this obtain claimed and has not released yet."""

    def next(self) -> Plan[D]:
        """What to do next, claiming what it will build. Call it again only after a ``WaitFor``."""
        building, view = self.planner.building, self.planner.view
        need, own = (self.chain[-1].base, False) if self.chain else (self.target, self.target in self.claims)
        while True:
            if not own:
                held, under_way = view.held_step(need), view.under_way_step(need)
                if not self.chain:  # the target: held or on its way, built by another, else ours
                    if held is not None or under_way is not None:
                        return Have(need)
                    if need in building:
                        return WaitFor(need)
                    self._claim(need, None)
                else:  # a base: only of an earlier step than the link that needs it
                    below = self.chain[-1].step
                    if held is not None:
                        return self.rebuild(need) if held < below else self.abandon()
                    if under_way is not None and under_way >= below:
                        return self.abandon()
                    built_at = building.get(need)
                    if built_at is not None and built_at >= below:
                        return self.abandon()  # never wait for a build of the same or a later step
                    if under_way is not None:
                        return self.rebuild(need)  # once that fetch ends
                    if need in building:
                        return WaitFor(need)
            delta = self.via if not self.chain and self.via is not None else view.delta_to(need)
            if delta is None or len(self.chain) >= self.planner.max_chain:
                return self.abandon()
            if self.chain and delta.step >= self.chain[-1].step:
                return self.abandon()  # a chain's steps decrease from the target
            self._claim(need, delta.step)
            self.chain.append(delta)
            need, own = delta.base, False

    def rebuild(self, base: bytes) -> Rebuild[D]:
        """The chain claimed so far, applied from ``base``."""
        return Rebuild(base, tuple(reversed(self.chain)))

    def built(self, delta: D) -> None:
        """``delta``'s target is rebuilt and held: its claim ends."""
        self._release(delta.target)

    def abandon(self) -> FetchWhole:
        """No chain, or a link did not rebuild: drop every claim but the target's and fetch it whole."""
        for mid in self.claims - {self.target}:
            self._release(mid)
        self.chain = []
        return FetchWhole(self.target)

    def close(self) -> None:
        """The obtain ended (held, fetched, or failed): release what it still claims."""
        for mid in list(self.claims):
            self._release(mid)

    def _claim(self, mid: bytes, step: int | None) -> None:
        self.claims.add(mid)
        self.planner.building[mid] = step

    def _release(self, mid: bytes) -> None:
        if mid in self.claims:
            self.claims.discard(mid)
            self.planner.building.pop(mid, None)
