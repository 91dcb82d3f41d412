"""This machine's own interface addresses (Linux), for what a node tells others to dial.

A node listening on the wildcard ``/ip4/0.0.0.0/tcp/4001`` (the README's default) used to advertise that
address itself in its JSON line, node.json and peer record; copied as another machine's ``--bootstrap``
nobody can dial it (issue 36). Advertised addresses name the interfaces instead. The trainer's torchrun
rendezvous uses the same lookup to find the interface towards its peers.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

SIOCGIFADDR = 0x8915
WILDCARD_IPV4 = "/ip4/0.0.0.0/"


def addresses_of(name: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IPv4 (SIOCGIFADDR) and IPv6 (/proc/net/if_inet6) addresses of interface ``name``."""
    found: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe, contextlib.suppress(OSError):
        request = struct.pack("256s", name.encode()[:15])
        found.add(ipaddress.IPv4Address(fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)[20:24]))
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            fields = line.split()
            if len(fields) == 6 and fields[5] == name:
                found.add(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
    return found


def interface_ipv4s() -> list[str]:
    """Every interface's IPv4 address, the loopback ones last (an address others can reach comes first)."""
    found: set[ipaddress.IPv4Address] = set()
    with contextlib.suppress(OSError):
        for _, name in socket.if_nameindex():
            found |= {a for a in addresses_of(name) if isinstance(a, ipaddress.IPv4Address)}
    usable = [a for a in found if not a.is_unspecified and not a.is_link_local]
    return [str(a) for a in sorted(usable, key=lambda a: (a.is_loopback, a.packed))]


def without_wildcards(multiaddrs: list[str], interfaces: list[str]) -> list[str]:
    """``multiaddrs`` with each ``/ip4/0.0.0.0/...`` replaced by the same address on every interface."""
    expanded: list[str] = []
    for multiaddr in multiaddrs:
        if multiaddr.startswith(WILDCARD_IPV4):
            rest = multiaddr[len(WILDCARD_IPV4) :]
            expanded += [f"/ip4/{ip}/{rest}" for ip in interfaces]
        else:
            expanded.append(multiaddr)
    return list(dict.fromkeys(expanded))
