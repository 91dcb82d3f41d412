"""``protocol.relay_reservations``: the relay's slot budget, as properties over any holders and askers."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import InvariantError
from protocol.relay_reservations import Holder, ReservationLimits, admit_reservation

GROUPS = ["10.0.0.0/24", "10.0.1.0/24", "2001:db8::/48", "127.0.0.1"]

limits_st = st.builds(
    lambda total, per_group, kept: ReservationLimits(total, per_group, min(kept, total - 1)),
    st.integers(1, 12),
    st.integers(1, 6),
    st.integers(0, 6),
)
asker_st = st.tuples(st.sampled_from(GROUPS), st.booleans())


def _run(limits: ReservationLimits, askers: list[tuple[str, bool]]) -> list[Holder]:
    """Grant slots to the askers in order (no one leaves); the holders at the end."""
    held: list[Holder] = []
    for i, (group, known) in enumerate(askers):
        asker = Holder(f"p{i}", group, known, float(i))
        decision = admit_reservation(held, asker, limits)
        if decision.evict is not None:
            assert not next(h for h in held if h.peer_id == decision.evict).known
            held = [h for h in held if h.peer_id != decision.evict]
        if decision.granted:
            held.append(asker)
        _check(limits, held)
    return held


def _check(limits: ReservationLimits, held: list[Holder]) -> None:
    strangers = [h for h in held if not h.known]
    assert len(held) <= limits.total
    assert len(strangers) <= limits.total - limits.reserved_known
    assert max(Counter(h.group for h in strangers).values(), default=0) <= limits.per_group


@given(limits_st, st.lists(asker_st, max_size=40))
def test_budgets_hold_for_any_sequence_of_askers(
    limits: ReservationLimits, askers: list[tuple[str, bool]]
) -> None:
    _run(limits, askers)


@given(limits_st, st.lists(asker_st, max_size=40), st.sampled_from(GROUPS))
def test_a_known_member_gets_a_slot_unless_members_hold_them_all(
    limits: ReservationLimits, askers: list[tuple[str, bool]], group: str
) -> None:
    held = _run(limits, askers)
    decision = admit_reservation(held, Holder("member", group, True, 1e9), limits)
    assert decision.granted == (sum(h.known for h in held) < limits.total)


@given(limits_st, st.lists(st.sampled_from(GROUPS), max_size=40), st.sampled_from(GROUPS))
def test_one_group_of_strangers_cannot_keep_another_out(
    limits: ReservationLimits, flood: list[str], group: str
) -> None:
    """Strangers of ``per_group`` full groups hold at most that many slots each: another group's stranger
    gets one while the stranger slots exceed the groups' caps."""
    held = _run(limits, [(g, False) for g in flood if g != group])
    busy_groups = len({h.group for h in held})
    decision = admit_reservation(held, Holder("honest", group, False, 1e9), limits)
    if busy_groups * limits.per_group < limits.total - limits.reserved_known:
        assert decision.granted


def test_a_holder_refreshes_and_a_member_displaces_the_newest_stranger_of_the_most_crowded_group() -> None:
    limits = ReservationLimits(total=4, per_group=2, reserved_known=0)
    held = [
        Holder("a1", "A", False, 1.0),
        Holder("a2", "A", False, 4.0),
        Holder("b1", "B", False, 2.0),
        Holder("m", "A", True, 3.0),
    ]
    assert admit_reservation(held, held[1], limits).reason == "refresh"
    decision = admit_reservation(held, Holder("m2", "B", True, 5.0), limits)
    assert decision.granted and decision.evict == "a2"
    assert admit_reservation(held, Holder("c", "C", False, 5.0), limits).reason == "full"
    assert admit_reservation(held[:3], Holder("a3", "A", False, 5.0), limits).reason == "group_full"


@pytest.mark.parametrize("args", [(0, 1, 0), (4, 0, 0), (4, 1, 4), (4, 1, -1)])
def test_bad_limits_are_refused(args: tuple[int, int, int]) -> None:
    with pytest.raises(InvariantError):
        ReservationLimits(*args)
