"""A throwaway network of Linux network namespaces for benchmarks: every peer gets its own namespace, one
veth link to a shared bridge and, if asked, a token-bucket cap on its upload and its download.

Why namespaces: peers on 127.0.0.1 share one unlimited loopback, so a broadcast measured there says
nothing about links. Here each peer's link is a real device with its own queue, so a cap on it holds for
every connection of that peer at once, as a home or datacenter uplink does.

Layout (nothing is created in the caller's namespace):

    <prefix>-hub      bridge br0, and one veth end ``p<i>`` per peer (its egress = peer i's download)
    <prefix>-p<i>     eth0 = 10.<net>.0.<i+1>/16  (its egress = peer i's upload)

Shaping is ``tc tbf`` on the egress of each end, which counts the Ethernet frames; the links use a 9000-byte
MTU so TCP/IP headers cost under 1% of a capped rate (about 4.5% at 1500). Needs root (CAP_NET_ADMIN);
``Lab.available()`` says whether this process can make namespaces at all.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

NAME_PREFIX = "pnbench"
MTU = 9000
TBF_BURST = "256kb"
TBF_LATENCY = "50ms"
_COMMAND_TIMEOUT = 20.0


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be made (the message names the command and its stderr)."""


@dataclass(frozen=True)
class NetPeer:
    """One peer's namespace: where to run its process and the address others reach it on."""

    index: int
    namespace: str
    address: str
    hub_link: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check=check)


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            list(argv), check=False, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(argv)}: {exc}") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces of earlier labs whose creating process is gone (a run killed with SIGKILL).

    Only names this module makes (``pnbench-<pid>-...``) are touched, and only when ``<pid>`` is dead.
    """
    listing = _ip("netns", "list", check=False).stdout
    removed = []
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{NAME_PREFIX}-(\d+)-\w+", name)
        if match and not _pid_alive(int(match.group(1))):
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    return removed


class Lab:
    """``count`` peer namespaces on one bridge. Use as a context manager: ``close`` deletes everything
    (also after a failed ``create``); it is idempotent."""

    def __init__(self, count: int, *, net: int = 77) -> None:
        if not 1 <= count <= 250:
            raise ValueError("count must be 1..250")
        self.prefix = f"{NAME_PREFIX}-{os.getpid()}"
        self.hub = f"{self.prefix}-hub"
        self.peers = [NetPeer(i, f"{self.prefix}-p{i}", f"10.{net}.0.{i + 1}", f"p{i}") for i in range(count)]
        self._made: list[str] = []

    @staticmethod
    def available() -> str | None:
        """None if namespaces can be made here, else why not (one line)."""
        if os.geteuid() != 0:
            return "needs root (CAP_NET_ADMIN) to create network namespaces"
        search = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
        for tool in ("ip", "tc"):
            if shutil.which(tool, path=search) is None:
                return f"`{tool}` (iproute2) is not installed"
        return None

    def __enter__(self) -> Lab:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        remove_stale_namespaces()
        self._add_namespace(self.hub)
        hub = ("-n", self.hub)
        _ip(*hub, "link", "set", "lo", "up")
        _ip(*hub, "link", "add", "br0", "mtu", str(MTU), "type", "bridge")
        _ip(*hub, "link", "set", "br0", "up")
        for peer in self.peers:
            self._add_namespace(peer.namespace)
            _ip(*hub, "link", "add", peer.hub_link, "mtu", str(MTU), "type", "veth",
                "peer", "name", "eth0", "netns", peer.namespace)  # fmt: skip
            _ip(*hub, "link", "set", peer.hub_link, "master", "br0", "up")
            inside = ("-n", peer.namespace)
            _ip(*inside, "link", "set", "lo", "up")
            _ip(*inside, "addr", "add", f"{peer.address}/16", "dev", "eth0")
            _ip(*inside, "link", "set", "eth0", "mtu", str(MTU), "up")

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def shape(self, peer: NetPeer, *, upload_bytes_s: float | None, download_bytes_s: float | None) -> None:
        """Cap ``peer``'s upload (egress of its eth0) and download (egress of the hub's end); None: no
        cap. Replaces any earlier cap."""
        for namespace, device, rate in (
            (peer.namespace, "eth0", upload_bytes_s),
            (self.hub, peer.hub_link, download_bytes_s),
        ):
            _run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], check=False)
            if rate:
                bits = int(rate * 8)
                _run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
                      "rate", f"{bits}bit", "burst", TBF_BURST, "latency", TBF_LATENCY])  # fmt: skip

    def exec_args(self, peer: NetPeer, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``peer``'s namespace (``ip netns exec`` execs it: the pid is the process's)."""
        return ["ip", "netns", "exec", peer.namespace, *argv]

    def sent_bytes(self, peer: NetPeer) -> int:
        """Bytes ``peer`` has put on its link (eth0 tx counter)."""
        text = _ip("-n", peer.namespace, "-s", "link", "show", "dev", "eth0").stdout
        match = re.search(r"TX:.*\n\s*(\d+)", text)
        return int(match.group(1)) if match else 0

    def close(self) -> None:
        """Delete every namespace this lab made (their veths and the bridge go with them)."""
        while self._made:
            _ip("netns", "delete", self._made.pop(), check=False)
