"""The delta-chain planner (protocol/swarm/rebuild.py): a hypothesis state machine runs many obtains at
once against hostile deltas (any base, target and step, signed in circles, chains longer than allowed),
fetches that end or fail and versions dropped by retention, and checks after every step that no obtain
waits in a circle, no chain is longer than the maximum or broken, the builds in flight are exactly the
obtains' claims, and that from any state every obtain still ends (held, or fetched whole when every
delta fails); plus the rules one at a time."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from protocol.errors import LocalProtocolError
from protocol.swarm.rebuild import (
    MAX_CHAIN,
    Build,
    FetchWhole,
    Have,
    Plan,
    Rebuild,
    RebuildPlanner,
    WaitFor,
)

FULLS = 6
INDEXES = st.integers(0, FULLS - 1)
STEPS = st.integers(0, 6)


def mid_of(i: int) -> bytes:
    return bytes([i]) * 32


@dataclass(frozen=True)
class FakeDelta:
    name: int
    step: int
    base: bytes
    target: bytes


@dataclass
class World:
    """What a node holds and knows (the planner's ``ChainView``); a delta is chosen at random among
    those known, so no property leans on the holdings' preference for a held base."""

    held: dict[bytes, int] = field(default_factory=dict)
    under_way: dict[bytes, int] = field(default_factory=dict)
    deltas: dict[bytes, list[FakeDelta]] = field(default_factory=dict)
    seed: int = 0
    """Picks the delta (a small generator: the world is copied often, a ``random.Random`` is large)."""

    def held_step(self, mid: bytes) -> int | None:
        return self.held.get(mid)

    def under_way_step(self, mid: bytes) -> int | None:
        return self.under_way.get(mid)

    def delta_to(self, target: bytes) -> FakeDelta | None:
        known = self.deltas.get(target, [])
        self.seed = (self.seed * 1103515245 + 12345) % (1 << 31)
        return known[(self.seed >> 8) % len(known)] if known else None

    def learn(self, delta: FakeDelta) -> None:
        self.deltas.setdefault(delta.target, []).append(delta)


@dataclass
class Task:
    """One obtain, as the executor (prime_node/swarm/delta_chain.py) drives it."""

    build: Build[FakeDelta]
    plan: Plan[FakeDelta] | None = None
    applied: int = 0
    """Links of the current ``Rebuild`` applied so far."""
    ended: str | None = None
    """``held``, ``fetched``, ``rebuilt`` or ``error`` once over."""


class Node:
    """The world, the planner and the obtains in flight: what one swarm service holds."""

    def __init__(self, steps: dict[bytes, int], max_chain: int, seed: int) -> None:
        self.steps = steps
        self.world = World(seed=seed)
        self.planner: RebuildPlanner[FakeDelta] = RebuildPlanner(self.world, max_chain=max_chain)
        self.tasks: list[Task] = []

    def live(self) -> list[Task]:
        return [task for task in self.tasks if task.ended is None]

    def owner(self, mid: bytes) -> Task | None:
        return next((task for task in self.live() if mid in task.build.claims), None)

    def end(self, task: Task, how: str) -> None:
        task.build.close()
        task.ended = how

    def advance(self, task: Task, *, good: bool) -> None:
        """One step of ``task``: plan (again, after a wait), or carry its plan one step further; ``good``:
        whether a delta applied now rebuilds its target."""
        plan = task.plan
        if plan is None or isinstance(plan, WaitFor):
            self.replan(task)
        elif isinstance(plan, Have):
            if plan.target in self.world.held:
                self.end(task, "held")
            elif plan.target not in self.world.under_way:
                self.end(task, "error")  # the fetch failed: the caller gets its error
        elif isinstance(plan, Rebuild):
            self.apply(task, plan, good=good)
        elif plan.target in self.world.held:
            self.end(task, "fetched")
        elif plan.target not in self.world.under_way:
            if task.applied < 0:
                self.end(task, "error")  # it started and failed
            else:
                self.world.under_way[plan.target] = self.steps[plan.target]
                task.applied = -1

    def replan(self, task: Task) -> None:
        plan = task.build.next()
        task.plan, task.applied = plan, 0
        if isinstance(plan, Rebuild):
            check_chain(plan, task.build.target, self.planner.max_chain, self.world)

    def apply(self, task: Task, plan: Rebuild[FakeDelta], *, good: bool) -> None:
        base = plan.base if task.applied == 0 else plan.links[task.applied - 1].target
        if base in self.world.under_way:
            return  # waits for the fetch
        link = plan.links[task.applied]
        if link.target in self.world.held:  # fetched whole meanwhile
            rebuilt = True
        elif link.target in self.world.under_way:
            return
        else:
            # A delta rebuilds its target only from that very base, and only if its step is the target's.
            rebuilt = good and base in self.world.held and link.step == self.steps[link.target]
            if rebuilt:
                self.world.held[link.target] = self.steps[link.target]
        if not rebuilt:
            task.plan, task.applied = task.build.abandon(), 0
            return
        task.build.built(link)
        task.applied += 1
        if task.applied == len(plan.links):
            self.end(task, "rebuilt")

    def fingerprint(self) -> object:
        world = self.world
        return (
            sorted(world.held.items()),
            sorted(world.under_way.items()),
            [(task.plan, task.applied, task.ended) for task in self.tasks],
            sorted(self.planner.building.items()),
        )


def check_chain(plan: Rebuild[FakeDelta], target: bytes, max_chain: int, world: World) -> None:
    """A chain leads from its base to the target, through earlier steps first, within the maximum."""
    links = plan.links
    assert 1 <= len(links) <= max_chain
    assert links[0].base == plan.base and links[-1].target == target
    assert all(a.target == b.base for a, b in itertools.pairwise(links))
    assert all(a.step < b.step for a, b in itertools.pairwise(links))
    base_step = world.held.get(plan.base, world.under_way.get(plan.base))
    assert base_step is not None and base_step < links[0].step


class PlannerMachine(RuleBasedStateMachine):
    """Drives a RebuildPlanner the way the swarm service does, with a model of the world around it."""

    @initialize(
        steps=st.lists(STEPS, min_size=FULLS, max_size=FULLS),
        ordered=st.booleans(),
        max_chain=st.integers(1, 4),
        seed=st.integers(0, (1 << 31) - 1),
    )
    def start(self, steps: list[int], ordered: bool, max_chain: int, seed: int) -> None:
        """Full version i is step i (a trainer's run), or any step (several fulls of one step too)."""
        steps = list(range(FULLS)) if ordered else steps
        self.node = Node({mid_of(i): s for i, s in enumerate(steps)}, max_chain, seed)
        self.names = 0

    # --- the world ------------------------------------------------------------------------------------

    @rule(step=STEPS, base=INDEXES, produces=INDEXES, honest=st.booleans())
    def learn_delta(self, step: int, base: int, produces: int, honest: bool) -> None:
        """A trainer-signed delta (manifests never name the same base and target)."""
        if base == produces:
            return
        if honest:
            step = self.node.steps[mid_of(produces)]
        self.names += 1
        self.node.world.learn(FakeDelta(self.names, step, mid_of(base), mid_of(produces)))

    @rule(first=INDEXES, last=INDEXES)
    def learn_a_run_of_deltas(self, first: int, last: int) -> None:
        """Each full version from ``first`` to ``last`` as a delta against the one before."""
        for i in range(first + 1, last + 1):
            self.learn_delta(self.node.steps[mid_of(i)], i - 1, i, honest=True)

    @rule(i=INDEXES)
    def fetch_starts(self, i: int) -> None:
        """A full version fetched by id or followed: a fetch minds no build."""
        world, mid = self.node.world, mid_of(i)
        if mid not in world.held and mid not in world.under_way:
            world.under_way[mid] = self.node.steps[mid]

    @rule(data=st.data(), ok=st.booleans())
    def fetch_ends(self, data: st.DataObject, ok: bool) -> None:
        world = self.node.world
        if world.under_way:
            mid = data.draw(st.sampled_from(sorted(world.under_way)))
            step = world.under_way.pop(mid)
            if ok:
                world.held[mid] = step

    @rule(data=st.data())
    def dropped(self, data: st.DataObject) -> None:
        """Retention drops a held version (an obtain that counted on it finds it gone)."""
        world = self.node.world
        if world.held:
            del world.held[data.draw(st.sampled_from(sorted(world.held)))]

    # --- obtains --------------------------------------------------------------------------------------

    @rule(data=st.data(), wanted=INDEXES, through_delta=st.booleans())
    def fetch_of_a_delta_id(self, data: st.DataObject, wanted: int, through_delta: bool) -> None:
        """``fetch`` of a delta's id (its target, through it), or an obtain of a full version."""
        known = self.node.world.deltas.get(mid_of(wanted), [])
        via = data.draw(st.sampled_from(known)) if known and through_delta else None
        self.node.tasks.append(Task(self.node.planner.obtain(mid_of(wanted), via)))

    @rule(data=st.data())
    def follow_a_delta(self, data: st.DataObject) -> None:
        """A followed delta claims its target at once, unless it is held, under way or being built."""
        known = [d for ds in self.node.world.deltas.values() for d in ds]
        if not known:
            return
        delta = data.draw(st.sampled_from(known))
        world, planner = self.node.world, self.node.planner
        if delta.target in world.held or delta.target in world.under_way:
            return
        if planner.in_flight(delta.target):
            with pytest.raises(LocalProtocolError):
                planner.claim(delta.target, delta)
            return
        self.node.tasks.append(Task(planner.claim(delta.target, delta)))

    @precondition(lambda self: self.node.live())
    @rule(data=st.data(), good=st.booleans())
    def advance(self, data: st.DataObject, good: bool) -> None:
        task = data.draw(st.sampled_from(self.node.live()))
        self.node.advance(task, good=good)

    @precondition(lambda self: self.node.live())
    @rule(good=st.booleans())
    def everyone_moves(self, good: bool) -> None:
        for task in self.node.live():
            self.node.advance(task, good=good)

    # --- invariants -----------------------------------------------------------------------------------

    @invariant()
    def builds_in_flight_are_the_obtains_claims(self) -> None:
        claims = [mid for task in self.node.live() for mid in task.build.claims]
        assert len(claims) == len(set(claims)), "one version built by two obtains"
        assert set(claims) == set(self.node.planner.building)
        assert all(not task.build.claims for task in self.node.tasks if task.ended is not None)

    @invariant()
    def no_wait_cycle(self) -> None:
        """An obtain waits only for a build of an earlier step than the chain it holds (so waits never
        close a circle), and never for itself."""
        node = self.node
        for task in node.live():
            if not isinstance(task.plan, WaitFor):
                continue
            owner = node.owner(task.plan.mid)
            if owner is None:
                continue  # ended meanwhile: the waiter plans again
            assert owner is not task, "an obtain waits for its own build"
            mine = [node.planner.building[mid] for mid in task.build.claims]
            awaited = node.planner.building[task.plan.mid]
            if mine:  # a link waits: its own claims are of later steps than what it waits for
                assert all(step is not None for step in mine)
                assert awaited is None or awaited < min(s for s in mine if s is not None)
        # and so the graph "waits for the build of" is acyclic
        edges: dict[int, int] = {}
        for task in node.live():
            if isinstance(task.plan, WaitFor) and (owner := node.owner(task.plan.mid)) is not None:
                edges[id(task)] = id(owner)
        for start in edges:
            seen, at = {start}, start
            while at in edges:
                at = edges[at]
                assert at not in seen, "obtains wait for each other in a circle"
                seen.add(at)

    @invariant()
    def every_obtain_ends_and_a_whole_fetch_is_reachable(self) -> None:
        """From here, with fetches succeeding: every obtain ends whatever the deltas do, and with every
        delta failing each ends held (by someone else) or fetched whole."""
        for good in (False, True):
            node = copy.deepcopy(self.node)
            for _ in range(50 * (len(node.tasks) + 1) * (node.planner.max_chain + 2)):
                if not node.live():
                    break
                before = node.fingerprint()
                for task in node.live():
                    node.advance(task, good=good)
                for mid, step in list(node.world.under_way.items()):
                    del node.world.under_way[mid]
                    node.world.held[mid] = step
                assert node.fingerprint() != before or not node.live(), "obtains stuck"
            assert not node.live(), "obtains that never end"
            assert not node.planner.building
            for task, original in zip(node.tasks, self.node.tasks, strict=True):
                # Only a fetch that already failed ends an obtain in an error (the caller gets it).
                decided = isinstance(original.plan, Have) or original.applied < 0
                if original.ended is None and not decided:
                    assert task.ended != "error"


TestPlannerMachine = PlannerMachine.TestCase
TestPlannerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


# --- the rules one at a time ---------------------------------------------------------------------------


def world_with(held: dict[int, int], deltas: list[tuple[int, int, int]]) -> World:
    """Fulls ``held`` (index: step); ``deltas`` as (step, base index, target index)."""
    world = World(held={mid_of(i): s for i, s in held.items()})
    for name, (step, base, target) in enumerate(deltas):
        world.learn(FakeDelta(name, step, mid_of(base), mid_of(target)))
    return world


def test_a_delta_from_a_held_base_is_rebuilt_and_claims_its_target() -> None:
    planner = RebuildPlanner(world_with({0: 0}, [(1, 0, 1)]))
    build = planner.obtain(mid_of(1))
    plan = build.next()
    assert isinstance(plan, Rebuild) and plan.base == mid_of(0) and [d.step for d in plan.links] == [1]
    assert planner.building == {mid_of(1): 1}
    build.built(plan.links[0])
    assert planner.building == {}


def test_a_chain_is_walked_back_to_a_held_version_and_applied_oldest_first() -> None:
    planner = RebuildPlanner(world_with({0: 0}, [(1, 0, 1), (2, 1, 2), (3, 2, 3)]))
    plan = planner.obtain(mid_of(3)).next()
    assert isinstance(plan, Rebuild) and [d.step for d in plan.links] == [1, 2, 3]
    assert planner.building == {mid_of(1): 1, mid_of(2): 2, mid_of(3): 3}


@pytest.mark.parametrize(("links", "fetched_whole"), [(MAX_CHAIN, False), (MAX_CHAIN + 1, True)])
def test_a_chain_longer_than_the_maximum_is_fetched_whole(links: int, fetched_whole: bool) -> None:
    deltas = [(s, s - 1, s) for s in range(1, links + 1)]
    planner = RebuildPlanner(world_with({0: 0}, deltas))
    build = planner.obtain(mid_of(links))
    assert isinstance(build.next(), FetchWhole) == fetched_whole
    if fetched_whole:
        assert planner.building == {mid_of(links): links}  # only the target stays claimed
    build.close()
    assert planner.building == {}


def test_deltas_signed_in_a_circle_end_in_a_whole_fetch() -> None:
    """Step 2 from step 1 and a "step 1" from step 2, neither held: no waiting for itself."""
    planner = RebuildPlanner(world_with({}, [(2, 1, 2), (1, 2, 1)]))
    assert planner.obtain(mid_of(2)).next() == FetchWhole(mid_of(2))
    assert planner.building == {mid_of(2): 2}


def test_a_link_waits_for_an_earlier_build_but_never_for_a_later_one() -> None:
    world = world_with({0: 0}, [(1, 0, 1), (2, 1, 2)])
    planner = RebuildPlanner(world)
    first = planner.claim(mid_of(1), world.deltas[mid_of(1)][0])
    assert planner.obtain(mid_of(2)).next() == WaitFor(mid_of(1))  # step 2 waits for step 1's build
    first.close()
    # A build of a later step than the link that needs it: fetch whole rather than wait.
    planner = RebuildPlanner(world_with({}, [(5, 0, 1), (2, 1, 2)]))
    planner.claim(mid_of(1), FakeDelta(9, 5, mid_of(0), mid_of(1)))
    assert isinstance(planner.obtain(mid_of(2)).next(), FetchWhole)


def test_an_obtain_of_a_version_held_being_fetched_or_built_uses_that() -> None:
    world = world_with({0: 0}, [(1, 0, 1)])
    world.under_way[mid_of(3)] = 3
    planner = RebuildPlanner(world)
    assert planner.obtain(mid_of(0)).next() == Have(mid_of(0))
    assert planner.obtain(mid_of(3)).next() == Have(mid_of(3))
    planner.claim(mid_of(1), world.deltas[mid_of(1)][0])
    assert planner.obtain(mid_of(1)).next() == WaitFor(mid_of(1))
    assert planner.building == {mid_of(1): 1}


def test_without_a_delta_the_target_is_fetched_whole_and_a_failed_link_releases_the_chain() -> None:
    planner = RebuildPlanner(world_with({0: 0}, [(1, 0, 1), (2, 1, 2)]))
    assert planner.obtain(mid_of(4)).next() == FetchWhole(mid_of(4))
    build = planner.obtain(mid_of(2))
    plan = build.next()
    assert isinstance(plan, Rebuild) and len(plan.links) == 2
    assert build.abandon() == FetchWhole(mid_of(2))
    assert planner.building == {mid_of(4): None, mid_of(2): 2}


def test_a_base_of_the_same_step_or_later_is_not_used() -> None:
    planner = RebuildPlanner(world_with({0: 3}, [(1, 0, 1)]))
    assert isinstance(planner.obtain(mid_of(1)).next(), FetchWhole)
    world = world_with({}, [(1, 0, 1)])
    world.under_way[mid_of(0)] = 1
    assert isinstance(RebuildPlanner(world).obtain(mid_of(1)).next(), FetchWhole)


def test_a_claim_of_a_version_being_built_is_refused_and_max_chain_is_checked() -> None:
    world = world_with({0: 0}, [(1, 0, 1)])
    planner = RebuildPlanner(world)
    planner.claim(mid_of(1), world.deltas[mid_of(1)][0])
    with pytest.raises(LocalProtocolError):
        planner.claim(mid_of(1), world.deltas[mid_of(1)][0])
    with pytest.raises(LocalProtocolError):
        RebuildPlanner(world, max_chain=0)


def test_a_link_that_waited_checks_the_step_of_the_next_build_again() -> None:
    """A link waits for an earlier build of its base; that build fails and a (hostile) later-step delta
    claims the base, through the link's own target. Waiting again would close a circle (the recursion
    this planner replaced did wait): the link fetches whole instead."""
    world = world_with({}, [(5, 1, 2)])
    planner = RebuildPlanner(world)
    earlier = planner.claim(mid_of(1), FakeDelta(90, 3, mid_of(0), mid_of(1)))
    link = planner.obtain(mid_of(2))
    assert link.next() == WaitFor(mid_of(1))
    earlier.close()  # it failed: version 1 is neither held nor built
    later = planner.claim(mid_of(1), FakeDelta(91, 7, mid_of(2), mid_of(1)))
    assert later.next() == WaitFor(mid_of(2))  # step 7 may wait for the build of step 5
    assert link.next() == FetchWhole(mid_of(2))
