"""The dial policy for addresses learnt from peer records (protocol/dial_backoff.py, issue 35 item 5):
failed endpoints rest, doubling up to a cap, shared by every record naming them; proven ones stay
dialable for their own peer; memory is bounded."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.dial_backoff import (
    DialBackoff,
    DialBackoffConfig,
    endpoint_of,
    pause_after,
)
from protocol.errors import LocalProtocolError

VICTIM = "/ip4/10.0.0.9/tcp/4001"
PEERS = st.text(alphabet="abcdefgh123", min_size=1, max_size=6)


def at(transport: str, peer: str) -> str:
    return f"{transport}/p2p/{peer}"


def dials_over(backoff: DialBackoff, attempts: list[tuple[float, str]]) -> int:
    """Replay dial attempts (time, claiming peer) on one victim endpoint; each allowed dial fails."""
    dials = 0
    for now, peer in sorted(attempts):
        planned = backoff.plan((at(VICTIM, peer),), now)
        if planned:
            dials += 1
            backoff.failed(planned, now)
    return dials


def bound(horizon: float, config: DialBackoffConfig) -> int:
    """Dials a failing endpoint can get within ``horizon`` s: the doubling ramp, then one per cap."""
    ramp = math.ceil(math.log2(config.cap / config.base)) + 1
    return ramp + math.ceil(horizon / config.cap) + 1


@given(strikes=st.integers(0, 10_000))
def test_the_pause_doubles_up_to_the_cap(strikes: int) -> None:
    config = DialBackoffConfig(base=2.0, cap=300.0)
    pause = pause_after(strikes, config)
    assert 0 <= pause <= config.cap
    assert pause_after(strikes + 1, config) >= pause
    if strikes >= 1 and pause < config.cap:
        assert pause_after(strikes + 1, config) in (2 * pause, config.cap)


@given(
    attempts=st.lists(st.tuples(st.floats(0, 3600, allow_nan=False), PEERS), min_size=1, max_size=400),
    horizon=st.just(3600.0),
)
def test_a_failing_endpoint_gets_a_bounded_backing_off_number_of_dials(
    attempts: list[tuple[float, str]], horizon: float
) -> None:
    """However often, and for however many fresh keys, nodes try to dial a record's address that never
    completes the handshake, the endpoint is dialled at most the doubling ramp plus one per cap."""
    backoff = DialBackoff()
    assert dials_over(backoff, attempts) <= bound(horizon, backoff.config)


def test_strikes_rest_the_endpoint_doubling_for_every_record_naming_it() -> None:
    backoff = DialBackoff(DialBackoffConfig(base=2.0, cap=16.0))
    backoff.failed((at(VICTIM, "a"),), 0.0)
    assert backoff.resting_until(at(VICTIM, "a")) == 2.0
    assert backoff.plan((at(VICTIM, "b"),), 1.9) == ()  # another key naming the same listener
    backoff.failed(backoff.plan((at(VICTIM, "b"),), 2.0), 2.0)
    assert backoff.resting_until(at(VICTIM, "b")) == 6.0
    for now in (6.0, 14.0, 30.0):
        backoff.failed(backoff.plan((at(VICTIM, "c"),), now), now)
    assert backoff.strikes(at(VICTIM, "c")) == 5
    assert backoff.resting_until(at(VICTIM, "c")) == 46.0  # capped at 16


@given(others=st.lists(PEERS.filter(lambda p: p != "owner"), max_size=20))
def test_others_failing_at_a_proven_endpoint_neither_block_nor_unprove_its_owner(others: list[str]) -> None:
    backoff = DialBackoff()
    backoff.reached(at(VICTIM, "owner"))
    for second, peer in enumerate(others):
        backoff.failed(backoff.plan((at(VICTIM, peer),), float(second)), float(second))
    assert backoff.plan((at(VICTIM, "owner"),), 0.0) == (at(VICTIM, "owner"),)
    assert backoff.proven(at(VICTIM, "owner"))
    assert not backoff.disproven((at(VICTIM, "owner"),))


def test_the_owner_failing_unproves_and_success_resets() -> None:
    backoff = DialBackoff()
    owner = at(VICTIM, "owner")
    backoff.reached(owner)
    backoff.failed((owner,), 10.0)
    assert not backoff.proven(owner) and backoff.plan((owner,), 11.0) == ()
    assert backoff.disproven((owner,))
    backoff.reached(owner)
    assert backoff.strikes(owner) == 0 and backoff.plan((owner,), 11.0) == (owner,)


def test_proven_addresses_come_first_and_resting_ones_are_left_out() -> None:
    backoff = DialBackoff()
    good, bad, new = at("/ip4/1.1.1.1/tcp/1", "p"), at(VICTIM, "p"), at("/ip4/2.2.2.2/tcp/2", "p")
    backoff.reached(good)
    backoff.failed((bad,), 0.0)
    assert backoff.plan((new, bad, good, "garbage"), 1.0) == (good, new)
    assert not backoff.disproven((good, bad))


@given(failed=st.lists(PEERS, min_size=1, max_size=5), owner=PEERS)
def test_a_record_is_disproven_only_by_failures_of_its_own_peer(failed: list[str], owner: str) -> None:
    backoff = DialBackoff()
    for peer in failed:
        backoff.failed((at(VICTIM, peer),), 0.0)
    assert backoff.disproven((at(VICTIM, owner),)) == (failed[-1] == owner)
    assert not backoff.disproven(())  # no address: steers no dial


def test_a_relayed_address_rests_its_relay_endpoint() -> None:
    relayed = at("/ip4/3.3.3.3/tcp/4001", "relay") + "/p2p-circuit/p2p/owner"
    endpoint = endpoint_of(relayed)
    assert endpoint is not None and (endpoint.transport, endpoint.expected_peer) == (
        "/ip4/3.3.3.3/tcp/4001",
        "relay",
    )
    backoff = DialBackoff()
    backoff.failed((relayed,), 0.0)
    assert backoff.plan((relayed,), 1.0) == ()


@given(st.text(max_size=80))
def test_any_text_parses_or_is_left_out(text: str) -> None:
    endpoint = endpoint_of(text)
    assert endpoint is None or (endpoint.transport.startswith("/") and endpoint.expected_peer)
    backoff = DialBackoff()
    backoff.failed((text,), 0.0)
    backoff.reached(text)
    assert len(backoff.plan((text,), 0.0)) <= 1


@given(transports=st.lists(st.integers(0, 10_000), max_size=300))
def test_memory_is_bounded(transports: list[int]) -> None:
    backoff = DialBackoff(DialBackoffConfig(max_endpoints=50))
    for port in transports:
        backoff.failed((at(f"/ip4/1.2.3.4/tcp/{port}", "p"),), 0.0)
        assert len(backoff) <= 50


def test_bad_config_is_refused() -> None:
    with pytest.raises(LocalProtocolError):
        DialBackoffConfig(base=10.0, cap=1.0)
