"""The pure per-IP-group budgets: inbound admission (protocol/connection_admission.py) and DHT provider
records (protocol/provider_selection.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.connection_admission import ConnectionLimits, InboundAdmission, ip_group
from protocol.errors import InvariantError, LocalProtocolError
from protocol.provider_selection import ProviderCandidate, admit_provider, select_providers


def test_ip_groups_are_slash_24_and_slash_48_on_public_networks_and_exact_on_local_ones() -> None:
    assert ip_group("203.0.113.7") == ip_group("203.0.113.250") == "203.0.113.0/24"
    assert ip_group("203.0.114.7") != ip_group("203.0.113.7")
    assert ip_group("2001:db8:1:2::5") == ip_group("2001:db8:1:ffff::9") == "2001:db8:1::/48"
    assert ip_group("::ffff:203.0.113.9") == "203.0.113.0/24"
    assert ip_group("127.0.0.1") == "127.0.0.1"
    assert ip_group("127.0.9.1") != ip_group("127.0.9.2")
    assert ip_group("192.168.1.4") == "192.168.1.4"
    assert ip_group("example.org") == "host:example.org"
    assert ip_group("203.0.113.7", ipv4_prefix=16) == "203.0.0.0/16"


def test_bad_limits_are_refused() -> None:
    with pytest.raises(InvariantError):
        ConnectionLimits(pending_per_group=0)
    with pytest.raises(InvariantError):
        ConnectionLimits(handshake_timeout=0)
    with pytest.raises(InvariantError):
        ConnectionLimits(ipv4_prefix=33)


def test_a_full_group_evicts_its_own_oldest_pending_connection() -> None:
    admission = InboundAdmission(ConnectionLimits(pending_per_group=2, pending_total=10))
    assert admission.open(1, "a", 0.0).evict == ()
    assert admission.open(2, "a", 1.0).evict == ()
    assert admission.open(3, "b", 2.0).evict == ()
    decision = admission.open(4, "a", 3.0)
    assert decision.admitted and decision.evict == (1,)
    assert admission.pending_count("a") == 2 and admission.pending_count("b") == 1
    with pytest.raises(LocalProtocolError):
        admission.open(4, "a", 4.0)


def test_a_full_table_evicts_from_the_most_crowded_group_and_spares_known_peers() -> None:
    admission = InboundAdmission(
        ConnectionLimits(pending_per_group=5, pending_total=4, pending_reserved_known=1)
    )
    admission.open(1, "honest", 0.0)
    for conn_id in (2, 3, 4):
        admission.open(conn_id, "flood", float(conn_id))
    assert admission.open(5, "new", 5.0).evict == (2,)
    assert admission.open(6, "known", 6.0, known=True).evict == ()  # its own reserved slot
    assert admission.is_pending(1) and admission.is_pending(6)
    assert admission.open(7, "known", 7.0, known=True).evict == (6,)


def test_established_connections_are_bounded_per_group_and_in_all_but_not_for_known_peers() -> None:
    admission = InboundAdmission(ConnectionLimits(established_per_group=2, established_total=3))
    for conn_id in range(6):
        admission.open(conn_id, "sybil" if conn_id < 4 else "other", 0.0)
    assert admission.establish(0).admitted and admission.establish(1).admitted
    assert admission.establish(2).reason == "group_full"
    assert admission.establish(3, known=True).admitted
    assert admission.establish(4).admitted
    assert admission.establish(5).reason == "inbound_full"
    admission.close(0)
    admission.open(9, "sybil", 1.0)
    assert admission.establish(9).admitted
    assert admission.establish(42).reason == "not_pending"


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["open", "establish", "close"]),
            st.integers(0, 30),
            st.sampled_from(["a", "b", "c", "d"]),
            st.booleans(),
        ),
        max_size=200,
    )
)
def test_budgets_hold_under_any_sequence_of_events(events: list[tuple[str, int, str, bool]]) -> None:
    limits = ConnectionLimits(
        pending_per_group=3,
        pending_total=5,
        pending_reserved_known=2,
        established_per_group=2,
        established_total=4,
    )
    admission = InboundAdmission(limits)
    opened: set[int] = set()
    known_established: set[int] = set()
    for step, (kind, conn_id, group, known) in enumerate(events):
        if kind == "open" and conn_id not in opened:
            opened.add(conn_id)
            decision = admission.open(conn_id, group, float(step), known=known)
            assert decision.admitted and conn_id not in decision.evict
        elif kind == "establish":
            if admission.establish(conn_id, known=known).admitted and known:
                known_established.add(conn_id)
        elif kind == "close":
            admission.close(conn_id)
            known_established.discard(conn_id)
        strangers_pending = [p for p in admission._pending.values() if not p.known]
        assert len(strangers_pending) <= limits.pending_total
        assert len(admission._pending) <= limits.pending_total + limits.pending_reserved_known
        for g in "abcd":
            assert sum(1 for p in strangers_pending if p.group == g) <= limits.pending_per_group
            strangers_established = sum(1 for gg, k in admission._established.values() if gg == g and not k)
            assert strangers_established <= limits.established_per_group
        assert sum(1 for _, k in admission._established.values() if not k) <= limits.established_total


def _candidates(spec: str) -> list[ProviderCandidate]:
    """'a1 a2 b1 K:c1' -> candidates with group = first letter, known when prefixed K:."""
    out = []
    for word in spec.split():
        known = word.startswith("K:")
        name = word.removeprefix("K:")
        out.append(ProviderCandidate(name, name[0], known))
    return out


def test_lookups_list_known_peers_first_then_round_robin_across_groups_bounded_per_group() -> None:
    chosen = select_providers(_candidates("s1 s2 s3 s4 s5 h1 K:x1 t1 s1"), per_group=2, limit=10)
    assert [c.peer_id for c in chosen] == ["x1", "s1", "h1", "t1", "s2"]
    assert [c.peer_id for c in select_providers(_candidates("s1 s2 h1"), per_group=2, limit=2)] == [
        "s1",
        "h1",
    ]


@given(
    st.lists(st.tuples(st.integers(0, 40), st.sampled_from("abc"), st.booleans()), max_size=60),
    st.integers(1, 4),
    st.integers(0, 30),
)
def test_selection_never_exceeds_its_bounds_and_keeps_every_group_represented(
    raw: list[tuple[int, str, bool]], per_group: int, limit: int
) -> None:
    candidates = [ProviderCandidate(f"p{n}", group, known) for n, group, known in raw]
    chosen = select_providers(candidates, per_group=per_group, limit=limit)
    ids = [c.peer_id for c in chosen]
    assert len(ids) == len(set(ids)) <= limit
    first: dict[str, ProviderCandidate] = {}
    for candidate in candidates:
        first.setdefault(candidate.peer_id, candidate)
    for group in "abc":
        assert sum(1 for c in chosen if c.group == group and not c.known) <= per_group
    known_first = [c.known for c in chosen]
    assert known_first == sorted(known_first, reverse=True)
    groups = {c.group for c in first.values() if not c.known}
    known_count = sum(1 for c in first.values() if c.known)
    if limit >= known_count + len(groups):
        assert groups <= {c.group for c in chosen if not c.known}


def test_a_crowd_of_one_group_cannot_keep_an_honest_provider_out_of_a_full_record_list() -> None:
    stored: list[ProviderCandidate] = []
    for n in range(26):
        sybil = ProviderCandidate(f"sybil{n}", "203.0.113.0/24")
        decision = admit_provider(stored, sybil, capacity=20, per_group=8)
        if decision.store:
            stored.append(sybil)
    assert len(stored) == 8
    for n in range(14):
        honest = ProviderCandidate(f"honest{n}", f"198.51.{n}.0/24")
        decision = admit_provider(stored, honest, capacity=20, per_group=8)
        assert decision.store
        if decision.evict:
            stored = [s for s in stored if s.peer_id != decision.evict]
        stored.append(honest)
    assert len(stored) == 20
    assert sum(1 for s in stored if s.peer_id.startswith("sybil")) == 6
    assert admit_provider(
        stored, ProviderCandidate("sybil7", "203.0.113.0/24"), capacity=20, per_group=8
    ).store
    assert not admit_provider(
        stored, ProviderCandidate("sybil0", "203.0.113.0/24"), capacity=20, per_group=8
    ).store
    late = admit_provider(stored, ProviderCandidate("x", "198.51.0.0/24"), capacity=20, per_group=8)
    assert late.store and late.evict is not None and late.evict.startswith("sybil")
    known = admit_provider(stored, ProviderCandidate("k", "203.0.113.0/24", True), capacity=20, per_group=1)
    assert known.store and known.evict is not None


@given(
    st.lists(st.tuples(st.integers(0, 60), st.sampled_from("abcd"), st.booleans()), max_size=120),
    st.integers(1, 6),
    st.integers(1, 12),
)
def test_record_lists_stay_within_capacity_and_group_budgets(
    raw: list[tuple[int, str, bool]], per_group: int, capacity: int
) -> None:
    stored: list[ProviderCandidate] = []
    for n, group, known in raw:
        newcomer = ProviderCandidate(f"p{n}", group, known)
        decision = admit_provider(stored, newcomer, capacity=capacity, per_group=per_group)
        if not decision.store or decision.reason == "refresh":
            continue
        if decision.evict is not None:
            assert any(s.peer_id == decision.evict and not s.known for s in stored)
            stored = [s for s in stored if s.peer_id != decision.evict]
        stored.append(newcomer)
        assert len(stored) <= capacity
        for g in "abcd":
            assert sum(1 for s in stored if s.group == g and not s.known) <= per_group
