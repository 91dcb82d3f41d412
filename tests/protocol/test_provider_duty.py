"""``provides_run``: with the same membership, the members agree on who announces the run in the DHT;
``first_decision_due``: they decide once the membership they know has settled."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from protocol.provider_duty import (
    DECIDE_AFTER,
    DECIDE_LATEST,
    PROVIDERS,
    first_decision_due,
    provides_run,
)

KEY = "/prime-node/run/test"
peer_ids = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=60, unique=True)


@given(peer_ids)
def test_with_the_whole_membership_known_the_nearest_few_provide(members: list[str]) -> None:
    deciding = [m for m in members if provides_run(m, members, KEY)]
    assert len(deciding) == min(PROVIDERS, len(members))


@given(peer_ids, st.randoms())
def test_the_decision_does_not_depend_on_order_or_repeats(members: list[str], rng: object) -> None:
    shuffled = members * 2
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    for me in members:
        assert provides_run(me, shuffled, KEY) == provides_run(me, members, KEY)


@given(peer_ids, st.text(min_size=1, max_size=12))
def test_a_node_that_knows_fewer_members_than_the_quota_provides(members: list[str], me: str) -> None:
    assert provides_run(me, members[: PROVIDERS - 1], KEY)


@given(peer_ids)
def test_when_a_provider_leaves_the_next_nearest_takes_over(members: list[str]) -> None:
    providers = {m for m in members if provides_run(m, members, KEY)}
    gone = sorted(providers)[0]
    rest = [m for m in members if m != gone]
    after = {m for m in rest if provides_run(m, rest, KEY)}
    assert providers - {gone} <= after and len(after) == min(PROVIDERS, len(rest))


@given(
    since_joined=st.floats(0, 200),
    since_new_member=st.floats(0, 200),
    interval=st.floats(0.1, 10),
    links_full=st.booleans(),
)
def test_first_decision_waits_for_a_settled_view(
    since_joined: float, since_new_member: float, interval: float, links_full: bool
) -> None:
    """Never before ``DECIDE_AFTER`` and always by ``DECIDE_LATEST``; with links short, not while the members
    known are still growing (a slow 64-node formation gave 13 provides when the clock alone decided)."""
    due = first_decision_due(since_joined, since_new_member, interval, links_full=links_full)
    if since_joined < DECIDE_AFTER * interval:
        assert not due
    if since_joined >= DECIDE_LATEST * interval:
        assert due
    if due:  # more quiet time, or full links, never take a decision back
        assert first_decision_due(since_joined, since_new_member + 1.0, interval, links_full=links_full)
        assert first_decision_due(since_joined, since_new_member, interval, links_full=True)
    if not links_full and since_new_member < interval:
        assert due == (since_joined >= DECIDE_LATEST * interval)  # members still coming: wait


def test_a_node_still_learning_members_waits() -> None:
    assert not first_decision_due(25.0, 0.5, 2.0, links_full=False)  # past DECIDE_BY, members still coming
    assert first_decision_due(25.0, 2.0, 2.0, links_full=False)  # quiet for an interval
    assert first_decision_due(6.0, 0.0, 2.0, links_full=True)  # links full: their records arrived
