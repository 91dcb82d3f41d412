"""The depth of the trainer's demand follows the batches' round trip (issue 38, ``demand_depth``).

Measured before the rule (seed 1, 300 steps): batches reached the trainer 2 steps after their policy
(the typical age on arrival), the fixed depth of 2 queued them 2 more steps, so they were trained at age
4, the bound (``async_level`` 4), and every batch two inferers made beyond the demand went
``stale_in_queue`` (27 of 368 produced, 7.6 %). A depth of 1 kept them fresh but the trainer waited. Now
the trainer counts every batch it heard announced (an exact count), and the depth is the round trip + 1
within the bound."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from prime_node.roles.demand_plan import (
    ARRIVAL_WINDOW,
    AT_BOUND_SHARE,
    DEMAND_DEPTH,
    TrainerWants,
    demand_depth,
    upper_quartile,
)

AGES = st.lists(st.integers(0, 12), max_size=40)
LEVELS = st.integers(0, 10)
MOST = st.integers(1, 6)


@given(AGES, LEVELS, MOST)
def test_the_depth_is_at_least_one_step_and_at_most_the_cap(ages: list[int], level: int, most: int) -> None:
    assert 1 <= demand_depth(ages, level, most=most) <= most
    assert 1 <= demand_depth(ages, level) <= max(1, level - 1)  # the default cap: async_level - 1


@given(LEVELS, MOST)
def test_with_nothing_arrived_yet_the_depth_is_the_default_within_the_cap(level: int, most: int) -> None:
    assert demand_depth([], level, most=most) == min(most, DEMAND_DEPTH)


@given(AGES.filter(bool), LEVELS, MOST)
def test_a_deeper_queue_still_trains_a_typical_batch_inside_the_bound(
    ages: list[int], level: int, most: int
) -> None:
    """Above the floor of one step, a batch as late as three in four arrive, behind ``depth - 1``
    counted batches (the count is exact now), is trained at age ``late + depth - 1``: within the bound."""
    depth = demand_depth(ages, level, most=most)
    if depth > 1:
        assert upper_quartile(ages) + depth - 1 <= level


@given(AGES.filter(bool), LEVELS, MOST)
def test_the_depth_is_the_round_trip_plus_one_when_the_bound_allows_it(
    ages: list[int], level: int, most: int
) -> None:
    """Little's law: the trainer never waits with the late age's worth of batches on their way and the
    one it trains next; never deeper than that, and exactly that when the bound and the cap allow."""
    late = upper_quartile(ages)
    depth = demand_depth(ages, level, most=most)
    assert depth <= max(1, late + 1)
    if late + late <= level and late + 1 <= most:
        assert depth == late + 1


@given(AGES.filter(bool), AGES, st.integers(0, 16), LEVELS)
def test_batches_trained_at_the_bound_never_deepen_the_queue(
    ages: list[int], trained: list[int], at_bound: int, level: int
) -> None:
    """More of the latest batches trained at the bound (or dropped past it): never a deeper queue, and
    one step shallower once more than one in ``AT_BOUND_SHARE`` were."""
    fresh = [min(age, level - 1) for age in trained] if level > 0 else []
    more = fresh[at_bound:] + [level] * min(at_bound, len(fresh))
    base = demand_depth(ages, level, trained_ages=fresh)
    assert demand_depth(ages, level, trained_ages=more) <= base
    if AT_BOUND_SHARE * min(at_bound, len(fresh)) > len(fresh) and base > 1:
        assert demand_depth(ages, level, trained_ages=more) == base - 1


@given(AGES.filter(bool))
def test_the_upper_quartile_is_an_age_with_at_most_a_quarter_above_it(ages: list[int]) -> None:
    late = upper_quartile(ages)
    assert late in ages
    assert 4 * sum(age > late for age in ages) <= len(ages)
    assert 4 * sum(age >= late for age in ages) >= len(ages)


def test_the_demos_round_trip_wants_three_steps_on_their_way_until_they_train_at_the_bound() -> None:
    """The stale helper's rule wanted one step here (``async_level - 1 - late``) and the trainer waited a
    round trip per step (busy share 0.57-0.75); with an exact count three fit inside the bound, two once
    more than one in eight of the batches train at the bound."""
    assert AT_BOUND_SHARE == 8
    assert demand_depth([2] * 16, 4) == 3
    assert demand_depth([2] * 16, 4, trained_ages=[3] * 14 + [4] * 2) == 3
    assert demand_depth([2] * 16, 4, trained_ages=[3] * 13 + [4] * 2 + [5]) == 2  # one dropped past it
    # the demo's measured mix (ages 0-3, mostly 1): a quarter arrive at 2 or later
    assert demand_depth([0] * 2 + [1] * 8 + [2] * 5 + [3], 4) == 3
    assert demand_depth([1, 1, 2, 1, 0, 1], 4) == DEMAND_DEPTH
    assert demand_depth([0] * 16, 4) == 1  # back within the step: one on its way is enough
    assert demand_depth([3, 2, 6, 5], 4) == 1  # batches arriving stale: never less than one step
    assert demand_depth([1] * 16, 8) == 2 and demand_depth([3] * 16, 8) == 4  # a looser bound


def test_the_trainer_wants_fewer_batches_once_they_arrive_late() -> None:
    """``TrainerWants`` (the counts the trainer's demand is planned from) reads the ages on arrival."""
    wants = TrainerWants(async_level=4)
    _, floor, wanted, _, fresh = wants.current(step=10, queued={}, queued_steps=0)
    assert (floor, sum(wanted), fresh) == (6, 2, 1)  # nothing measured: two steps' worth, as before
    for _ in range(ARRIVAL_WINDOW):
        wants.arrived(14, 10)
    assert wants.depth() == 1
    _, floor, wanted, _, fresh = wants.current(step=10, queued={}, queued_steps=0)
    assert (floor, wanted, fresh) == (6, (0, 0, 0, 0, 1), 1)  # the newest policy only
    _, _, wanted, _, fresh = wants.current(step=10, queued={10: 1}, queued_steps=1)
    assert (sum(wanted), fresh) == (0, 0)  # one step queued: the inferers wait
    # The window is the latest arrivals: quicker ones bring the depth back.
    for _ in range(ARRIVAL_WINDOW):
        wants.arrived(11, 10)
    assert wants.depth() == 2
    for _ in range(ARRIVAL_WINDOW):
        wants.arrived(12, 10)
    assert wants.depth() == 3
    wants.train(12, [10] * 14, 0)
    wants.train(12, [8] * 2, 0)  # two of the latest 16 batches trained at the bound (4) ...
    assert wants.depth() == 3
    wants.dropped([(11, 6)])  # ... and one dropped past it: more than one in eight
    assert wants.depth() == 2


def test_the_trainer_counts_where_its_batches_age() -> None:
    wants = TrainerWants(async_level=4)
    wants.arrived(12, 10)
    wants.arrived(12, 10)
    wants.arrived(10**9, 0)  # a batch far past the bound counts as just past it
    wants.train(12, [9], 1)
    wants.dropped([(7, 5)])
    assert wants.trained[9] == 1
    wants.stepped(13, 100.0)  # a step with no start seen: no busy time measured, no round trip
    wants.arrived(13, 13, 101.0)
    wants.train(13, [13], 0, 101.0)
    wants.stepped(14, 101.5)  # policy 14 made after a train of 0.5 s
    wants.arrived(14, 14, 103.0)  # 1.5 s after it: three busy steps
    assert wants.ages_status() == {
        "arrival": {0: 2, 2: 2, 5: 1},
        "trained": {0: 1, 3: 1},
        "stale": {2: 1},
        "queued": {0: 1, 1: 1},
        "trip": {3: 1},
    }
    assert 9 not in wants.trained  # past the bound of step 14: forgotten


@given(AGES.filter(bool), AGES, LEVELS, MOST)
def test_round_trips_only_deepen_the_queue_and_never_past_the_bound(
    ages: list[int], trips: list[int], level: int, most: int
) -> None:
    by_age = demand_depth(ages, level, most=most)
    depth = demand_depth(ages, level, round_trips=trips, most=most)
    assert by_age <= depth <= max(by_age, 1, min(most, level - upper_quartile(ages) + 1))


def test_a_waiting_trainer_reads_the_round_trip_in_busy_steps_not_the_age() -> None:
    """A lone inferer (issue 38): each batch arrived at age 0, because the trainer waited for it, so the
    age said one on the way was enough and the trainer kept waiting (busy share 0.15). Its round trip,
    0.4 s to a train of 0.1 s, says four busy steps: the depth is the cap, three steps' worth."""
    assert demand_depth([0] * ARRIVAL_WINDOW, 4) == 1
    assert demand_depth([0] * ARRIVAL_WINDOW, 4, round_trips=[4] * ARRIVAL_WINDOW) == 3
    wants = TrainerWants(async_level=4)
    now = 0.0
    for step in range(ARRIVAL_WINDOW):
        wants.arrived(step, step, now + 0.4)  # the policy made at ``now`` arrives 0.4 s later
        now += 0.4
        wants.train(step, [step], 0, now)
        now += 0.1
        wants.stepped(step + 1, now)
    assert wants.arrival_ages.count(0) == ARRIVAL_WINDOW
    assert wants.depth() == 3
    # A trainer that does not wait sees the same round trip as ages: nothing changes for it.
    busy = TrainerWants(async_level=4)
    for step in range(ARRIVAL_WINDOW):
        busy.train(step, [max(0, step - 1)], 1, step * 0.1)
        busy.stepped(step + 1, (step + 1) * 0.1)
        busy.arrived(step + 1, step, (step + 1) * 0.1 + 0.05)
    assert busy.depth() == demand_depth([1] * ARRIVAL_WINDOW, 4) == 2
