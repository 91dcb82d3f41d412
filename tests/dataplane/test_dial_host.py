"""Which host the data plane dials for a peer (prime_node/dataplane/dialer.py ``dial_host``): the first
direct IPv4/IPv6/DNS host of its multiaddrs; never a relay's host, a wildcard or anything unparsable."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given

from prime_node.dataplane.dialer import dial_host

PEER = "16Uiu2HAmDf7wW5pVvGdEBnY4ccTzQUiSY6X4LQjiVWNMxJB9vDbF"


def test_the_first_direct_host_is_dialled() -> None:
    relayed = f"/ip4/203.0.113.9/tcp/4001/p2p/{PEER}/p2p-circuit"
    assert dial_host((relayed, "/ip4/198.51.100.7/tcp/4001", "/ip4/10.0.0.2/tcp/4001")) == "198.51.100.7"
    assert dial_host(("/ip6/2001:db8::1/tcp/4001",)) == "2001:db8::1"
    assert dial_host(("/dns4/node.example/tcp/4001",)) == "node.example"


def test_relayed_wildcard_and_other_addresses_give_no_host() -> None:
    assert dial_host(()) is None
    assert dial_host((f"/ip4/203.0.113.9/tcp/4001/p2p/{PEER}/p2p-circuit",)) is None
    assert dial_host(("/ip4/0.0.0.0/tcp/4001", "/ip6/::/tcp/4001")) is None
    assert dial_host(("/unix/tmp/socket", "/ip4", "", "garbage")) is None


ADDRESS = st.one_of(
    st.text(max_size=40),
    st.builds(
        lambda kind, host, relayed: f"/{kind}/{host}/tcp/1" + (f"/p2p/{PEER}/p2p-circuit" if relayed else ""),
        st.sampled_from(["ip4", "ip6", "dns", "dns4", "dns6", "tcp", "unix"]),
        st.sampled_from(["0.0.0.0", "::", "192.0.2.1", "2001:db8::2", "a.example", ""]),
        st.booleans(),
    ),
)


def _direct_host(multiaddr: str) -> str | None:
    parts = multiaddr.split("/")
    if "/p2p-circuit" in multiaddr or len(parts) < 3 or parts[1] not in ("ip4", "ip6", "dns", "dns4", "dns6"):
        return None
    return None if parts[2] in ("0.0.0.0", "::") else parts[2]


@given(st.lists(ADDRESS, max_size=6).map(tuple))
def test_the_host_comes_from_the_first_direct_address_of_the_peer(multiaddrs: tuple[str, ...]) -> None:
    hosts = [h for h in map(_direct_host, multiaddrs) if h is not None]
    assert dial_host(multiaddrs) == (hosts[0] if hosts else None)
