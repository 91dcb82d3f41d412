"""The pure NAT rules: dial-back admission, whom to ask, verdicts, when to reserve, which relay to try."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from protocol.reachability import (
    INBOUND_EVIDENCE,
    MAX_DIALBACK_PORTS,
    PRIVATE_EVIDENCE,
    DialbackLimiter,
    RelayPicker,
    Status,
    combine,
    dialback_ports,
    probe_order,
    should_reserve,
    verdict,
)

PEER_IDS = st.text(alphabet="abcdefgh123", min_size=1, max_size=6)


@given(
    own=PEER_IDS,
    preferred=st.lists(PEER_IDS, max_size=4),
    connected=st.sets(PEER_IDS, max_size=20),
    limit=st.integers(0, 24),
)
def test_probe_order_puts_connected_bootstraps_first_then_every_other_peer_once(
    own: str, preferred: list[str], connected: set[str], limit: int
) -> None:
    order = probe_order(own, preferred, connected, limit)
    first = [p for p in dict.fromkeys(preferred) if p in connected]
    assert len(order) == len(set(order)) == min(limit, len(connected))
    assert set(order) <= connected
    assert order[: len(first)] == first[:limit]  # bootstrap peers lead, in the order given
    assert order == probe_order(own, preferred, sorted(connected, reverse=True), limit)  # input order free


def test_a_swarm_spreads_its_dial_back_requests_instead_of_asking_the_same_peer() -> None:
    """64 nodes all connected to each other and to one bootstrap: by peer ID, 63 of them chose the same
    peer after the bootstrap; ranked per node, no peer gets more than a few."""
    nodes = [f"16Uiu2HAm{i:04d}" for i in range(64)]
    choices = Counter(
        probe_order(own, ["boot"], ["boot", *(p for p in nodes if p != own)], 2)[1] for own in nodes
    )
    assert max(choices.values()) <= 6, choices.most_common(3)
    assert len(choices) >= 32


def test_limiter_allows_one_probe_per_peer_per_interval_and_a_bounded_burst_in_all() -> None:
    limiter = DialbackLimiter(per_peer_interval=20, global_burst=3, global_window=60, tracked_peers=2)
    assert limiter.allow("a", 0.0)
    assert not limiter.allow("a", 10.0)
    assert limiter.allow("b", 10.0)
    assert limiter.allow("c", 11.0)
    assert not limiter.allow("d", 12.0)  # three in the window already
    assert limiter.allow("a", 61.0)  # the window moved on and a's interval passed
    assert len(limiter._last) == 2  # bounded memory


def test_ports_are_valid_deduplicated_and_capped() -> None:
    assert dialback_ports([0, 4001, 4001, 70000, True, 5, 6, 7, 8, 9]) == [4001, 5, 6, 7][:MAX_DIALBACK_PORTS]


def test_verdicts_and_their_combination() -> None:
    assert verdict([]) == "unknown"
    assert verdict([False, False]) == "private"
    assert verdict([False, True]) == "public"
    assert combine(["unknown", "private"], failed_in_a_row=1, dialled_in_by=0) == "private"
    assert combine(["private", "public"], failed_in_a_row=1, dialled_in_by=0) == "public"
    assert combine([], failed_in_a_row=0, dialled_in_by=0) == "unknown"


def test_one_failed_dial_back_settles_a_node_no_one_dialled_but_not_one_others_reach() -> None:
    """A NAT'd home (no peer ever dialled it) is private after one failure, as fast as before; the
    saturated public bootstrap of a 64-process swarm, dialled by dozens, took one timed-out dial-back
    for proof and reserved a relay slot it did not need."""
    assert combine(["private"], failed_in_a_row=1, dialled_in_by=INBOUND_EVIDENCE - 1) == "private"
    assert combine(["private"], failed_in_a_row=1, dialled_in_by=INBOUND_EVIDENCE) == "unknown"
    assert combine(["private"], failed_in_a_row=PRIVATE_EVIDENCE, dialled_in_by=63) == "private"


@given(
    verdicts=st.lists(st.sampled_from(["public", "private", "unknown"]), max_size=8),
    failed_in_a_row=st.integers(0, 10),
    dialled_in_by=st.integers(0, 100),
)
def test_combination_rules(verdicts: list[Status], failed_in_a_row: int, dialled_in_by: int) -> None:
    status = combine(verdicts, failed_in_a_row=failed_in_a_row, dialled_in_by=dialled_in_by)
    if "public" in verdicts:
        assert status == "public"  # one dial-back that came in is proof
    elif "private" not in verdicts or failed_in_a_row == 0:
        assert status == "unknown"  # no failure, no verdict
    else:
        assert status == "private" or (
            dialled_in_by >= INBOUND_EVIDENCE and failed_in_a_row < PRIVATE_EVIDENCE
        )
        # without peers that dialled in, one failure is enough
        assert combine(verdicts, failed_in_a_row=failed_in_a_row, dialled_in_by=0) == "private"


def test_reserve_only_when_known_private_enabled_and_not_yet_held() -> None:
    assert should_reserve("private", reserved=False, enabled=True)
    assert not should_reserve("unknown", reserved=False, enabled=True)
    assert not should_reserve("public", reserved=False, enabled=True)
    assert not should_reserve("private", reserved=True, enabled=True)
    assert not should_reserve("private", reserved=False, enabled=False)


def test_relay_picker_rests_a_refusing_relay() -> None:
    picker = RelayPicker(retry_after=60)
    assert picker.pick(["r1", "r2"], 0.0) == "r1"
    picker.failed("r1", 0.0)
    assert picker.pick(["r1", "r2"], 1.0) == "r2"
    picker.failed("r2", 1.0)
    assert picker.pick(["r1", "r2"], 2.0) is None
    assert picker.pick(["r1", "r2"], 61.0) == "r1"
    picker.succeeded("r2")
    assert picker.pick(["r2"], 2.0) == "r2"
