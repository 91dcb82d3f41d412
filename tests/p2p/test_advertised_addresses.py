"""A node listening on the wildcard address advertises addresses others can dial (issue 36: ``join`` on
the README's default ``/ip4/0.0.0.0/tcp/4001`` printed that very address, and nobody can dial 0.0.0.0)."""

from __future__ import annotations

import functools
from pathlib import Path

import trio
from hypothesis import given
from hypothesis import strategies as st

from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.p2p.local_addresses import interface_ipv4s, without_wildcards
from tests.p2p.helpers import make_config, sees_all, start_node, wait_until

IPS = st.lists(
    st.ip_addresses(v=4).filter(lambda ip: not ip.is_unspecified).map(str),
    min_size=1,
    max_size=4,
    unique=True,
)
ADDRS = st.lists(
    st.sampled_from(["/ip4/0.0.0.0/tcp/4001/p2p/Q", "/ip4/127.0.0.1/tcp/4001/p2p/Q", "/ip4/10.0.0.5/tcp/1"]),
    max_size=4,
)


@given(ADDRS, IPS)
def test_a_wildcard_becomes_one_address_per_interface_and_nothing_else_changes(
    addrs: list[str], interfaces: list[str]
) -> None:
    expanded = without_wildcards(addrs, interfaces)
    assert not any(a.startswith("/ip4/0.0.0.0/") for a in expanded)
    assert len(expanded) == len(set(expanded))
    for addr in addrs:
        if addr.startswith("/ip4/0.0.0.0/"):
            assert all(f"/ip4/{ip}/tcp/4001/p2p/Q" in expanded for ip in interfaces)
        else:
            assert addr in expanded


def test_this_machines_interfaces_include_loopback_last() -> None:
    found = interface_ipv4s()
    assert "127.0.0.1" in found and "0.0.0.0" not in found
    assert found.index("127.0.0.1") >= len([ip for ip in found if not ip.startswith("127.")])


async def test_a_node_on_the_wildcard_advertises_dialable_addresses(tmp_path: Path) -> None:
    wildcard = functools.partial(open_libp2p_host, listen="/ip4/0.0.0.0/tcp/0")
    loopback = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")
    async with trio.open_nursery() as nursery:
        a, _ = await start_node(nursery, wildcard, make_config(tmp_path, 0, listen="/ip4/0.0.0.0/tcp/0"))
        advertised = a.advertised_multiaddrs()
        assert advertised and not any("/ip4/0.0.0.0/" in m for m in advertised)
        assert all(m.endswith(f"/p2p/{a.identity.peer_id}") for m in advertised)
        b, _ = await start_node(nursery, loopback, make_config(tmp_path, 1, bootstrap=(advertised[0],)))
        await wait_until(lambda: sees_all(a, [a, b]) and sees_all(b, [a, b]), timeout=60)
        nursery.cancel_scope.cancel()
