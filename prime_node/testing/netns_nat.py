"""A throwaway "internet" with two homes behind NAT routers, in Linux network namespaces (needs root and
``iptables``; ``NatLab.available()`` says whether this process can build one).

    <p>-pub   eth0 203.0.113.10/24            a public peer (bootstrap, relay)
    <p>-ra    wan 203.0.113.1/24, lan 192.168.1.1/24   home router A: MASQUERADE out of wan
    <p>-rb    wan 203.0.113.2/24, lan 192.168.2.1/24   home router B: MASQUERADE out of wan
    <p>-ha    eth0 192.168.1.2/24 via 192.168.1.1       home A
    <p>-hb    eth0 192.168.2.2/24 via 192.168.2.1       home B
    <p>-hub   bridge br0 joining pub, ra and rb (the "internet", 203.0.113.0/24: TEST-NET-3)

The routers behave like common home routers: outbound connections are masqueraded (Linux keeps the
source port when it is free, i.e. endpoint-independent port mapping; ``random_ports`` adds
``--random`` for a port-randomising NAT), inbound packets are forwarded only for tracked connections
and unsolicited ones are dropped, so the homes cannot dial each other or be dialled by the public peer.
Nothing is created in the caller's namespace; ``close`` deletes everything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

PREFIX = "pn-nat"
PUBLIC_IP = "203.0.113.10"
ROUTER_WAN = {"a": "203.0.113.1", "b": "203.0.113.2"}
HOME_IP = {"a": "192.168.1.2", "b": "192.168.2.2"}
_TIMEOUT = 20.0


class NatLabError(RuntimeError):
    """A namespace, link or firewall rule could not be made (the message names the command)."""


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NatLabError(f"{' '.join(argv)}: {exc}") from exc
    if check and done.returncode != 0:
        raise NatLabError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


@dataclass
class NatLab:
    """The namespaces above; ``ns("ha")`` is home A's namespace name. Use as a context manager."""

    random_ports: bool = False
    prefix: str = ""
    public_uplink_mbit: int | None = None
    """Cap what the public peer sends (``tc`` token bucket on its link), as a trainer's upload is small
    next to a whole swarm's: downloaders must then trade pieces among themselves."""

    def __post_init__(self) -> None:
        self.prefix = self.prefix or f"{PREFIX}-{os.getpid()}"
        self._made: list[str] = []

    @staticmethod
    def available() -> str | None:
        """None if a lab can be built here, else why not."""
        if os.geteuid() != 0:
            return "needs root"
        for tool in ("ip", "iptables", "tc"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        if _run(["ip", "netns", "list"], check=False).returncode != 0:
            return "ip netns is not usable"
        return None

    def ns(self, short: str) -> str:
        return f"{self.prefix}-{short}"

    def exec_prefix(self, short: str) -> list[str]:
        """The argv prefix that runs a command inside namespace ``short``."""
        return ["ip", "netns", "exec", self.ns(short)]

    def _in(self, short: str, *argv: str) -> None:
        _run([*self.exec_prefix(short), *argv])

    def __enter__(self) -> NatLab:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        for short in ("hub", "pub", "ra", "rb", "ha", "hb"):
            _run(["ip", "netns", "add", self.ns(short)])
            self._made.append(self.ns(short))
            self._in(short, "ip", "link", "set", "lo", "up")
        self._in("hub", "ip", "link", "add", "br0", "type", "bridge")
        self._in("hub", "ip", "link", "set", "br0", "up")
        self._link("pub", "eth0", "hub", "p-pub", f"{PUBLIC_IP}/24", bridge=True)
        if self.public_uplink_mbit is not None:
            rate = f"{self.public_uplink_mbit}mbit"
            self._in(
                "pub",
                "tc",
                "qdisc",
                "add",
                "dev",
                "eth0",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "64kb",
                "latency",
                "400ms",
            )
        for side in ("a", "b"):
            router, home = f"r{side}", f"h{side}"
            lan_net = "1" if side == "a" else "2"
            self._link(router, "wan", "hub", f"p-{router}", f"{ROUTER_WAN[side]}/24", bridge=True)
            self._link(home, "eth0", router, "lan", f"{HOME_IP[side]}/24")
            self._in(router, "ip", "addr", "add", f"192.168.{lan_net}.1/24", "dev", "lan")
            self._in(router, "ip", "link", "set", "lan", "up")
            self._in(home, "ip", "route", "add", "default", "via", f"192.168.{lan_net}.1")
            self._in(router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            masquerade = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]
            self._in(router, *masquerade, *(["--random"] if self.random_ports else []))
            tracked = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
            self._in(router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", *tracked)
            self._in(router, "iptables", "-A", "FORWARD", "-i", "wan", "-j", "DROP")
            self._in(router, "iptables", "-A", "INPUT", "-i", "wan", *tracked)
            self._in(router, "iptables", "-A", "INPUT", "-i", "wan", "-j", "DROP")

    def _link(
        self, a: str, a_name: str, b: str, b_name: str, a_address: str, *, bridge: bool = False
    ) -> None:
        peer = ["peer", "name", b_name, "netns", self.ns(b)]
        _run(["ip", "link", "add", a_name, "netns", self.ns(a), "type", "veth", *peer])
        self._in(a, "ip", "addr", "add", a_address, "dev", a_name)
        self._in(a, "ip", "link", "set", a_name, "up")
        if bridge:
            self._in(b, "ip", "link", "set", b_name, "master", "br0")
        self._in(b, "ip", "link", "set", b_name, "up")

    def close(self) -> None:
        """Delete every namespace this lab made (their links and rules go with them)."""
        for name in reversed(self._made):
            _run(["ip", "netns", "del", name], check=False)
        self._made.clear()

    def conntrack_entries(self, router: str) -> str:
        """The router's tracked connections (for reports; empty if the conntrack tool is missing)."""
        if shutil.which("conntrack") is None:
            return ""
        return _run([*self.exec_prefix(router), "conntrack", "-L"], check=False).stdout
