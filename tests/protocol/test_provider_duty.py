"""``provides_run``: with the same membership, the members agree on who announces the run in the DHT."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from protocol.provider_duty import PROVIDERS, provides_run

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
