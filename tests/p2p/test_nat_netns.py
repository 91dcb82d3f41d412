"""Two homes behind their own NAT routers and one public bootstrap, in network namespaces
(prime_node/testing/netns_nat.py): each home learns it is private, reserves a relay slot on the bootstrap,
the homes find each other through the bootstrap and connect through the relay, then hole punching (DCUtR)
makes the connection direct and a libp2p stream between the homes works. Behind port-randomising NATs
(MASQUERADE --random) hole punching fails and the homes keep talking through the relay.

Slow and root-only; skipped where namespaces or iptables are not available.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from prime_node.testing.netns_nat import HOME_IP, PUBLIC_IP, ROUTER_WAN, NatLab

pytestmark = pytest.mark.slow
ENV = {**os.environ, "PRIME_NODE_LOG_LEVEL": "warning"}
PYTHON = sys.executable
DEADLINE = float(os.environ.get("NAT_TEST_DEADLINE", "150"))


class Peer:
    """A process in a namespace whose stdout JSON lines are collected by a thread."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self._stderr = log.open("w")
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=ENV)
        self.lines: list[dict[str, Any]] = []
        self._out = log.with_suffix(".out").open("w")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self._out.write(raw)
            self._out.flush()
            try:
                value = json.loads(raw)
            except ValueError:
                continue
            if isinstance(value, dict):
                self.lines.append(value)

    def identity(self) -> dict[str, Any] | None:
        return next((line for line in self.lines if "peer_id" in line and "multiaddrs" in line), None)

    def latest(self) -> dict[str, Any]:
        reports = [line for line in self.lines if "reach" in line]
        return reports[-1] if reports else {}

    def first(self, predicate: Any) -> dict[str, Any] | None:
        return next((line for line in self.lines if "reach" in line and predicate(line)), None)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self._stderr.close()


def _wait(predicate: Any, timeout: float, peers: list[Peer], what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for peer in peers:
            if peer.process.poll() is not None:
                raise AssertionError(f"{peer.log.name} exited: {peer.log.read_text()[-2000:]}")
        time.sleep(0.2)
    tails = "\n".join(f"{p.log.name}: {p.latest()} {p.log.read_text()[-1500:]}" for p in peers)
    raise AssertionError(f"{what} not within {timeout} s\n{tails}")


def _home(
    lab: NatLab, side: str, boot: str, tmp_path: Path, echo: str = "--echo", extra: tuple[str, ...] = ()
) -> Peer:
    argv = [
        *lab.exec_prefix(f"h{side}"),
        PYTHON,
        "-m",
        "tests.p2p.nat_peer",
        "--listen",
        f"/ip4/{HOME_IP[side]}/tcp/4001",
        "--bootstrap",
        boot,
        "--data-dir",
        str(tmp_path / f"home_{side}"),
        echo,
        *extra,
        *(["--libp2p-debug"] if os.environ.get("NAT_TEST_DEBUG") else []),
    ]
    return Peer(argv, tmp_path / f"home_{side}.log")


def _start_bootstrap(lab: NatLab, tmp_path: Path, peers: list[Peer]) -> str:
    """A real ``prime-node join`` on the public address (relay service on by default); its multiaddr."""
    argv = [
        *lab.exec_prefix("pub"),
        PYTHON,
        "-m",
        "prime_node",
        "join",
        "--listen",
        f"/ip4/{PUBLIC_IP}/tcp/4001",
        "--run",
        "nattest",
        "--data-dir",
        str(tmp_path / "boot"),
        "--heartbeat-interval",
        "1",
        "--new-wallet",
        "--no-password",
        "--light-kdf",
    ]
    boot = Peer(argv, tmp_path / "boot.log")
    peers.append(boot)
    _wait(lambda: boot.identity() is not None, 60, peers, "bootstrap identity")
    identity = boot.identity()
    assert identity is not None
    return str(next(a for a in identity["multiaddrs"] if PUBLIC_IP in a))


def _start_homes(lab: NatLab, tmp_path: Path, peers: list[Peer], echo: str) -> list[Peer]:
    """Both homes; returns once each found it is private and holds a relay slot on the bootstrap."""
    boot_addr = _start_bootstrap(lab, tmp_path, peers)
    homes = [_home(lab, side, boot_addr, tmp_path, echo) for side in ("a", "b")]
    peers += homes
    _wait(
        lambda: all(h.latest().get("reach", {}).get("relay_reserved") for h in homes),
        60,
        peers,
        "private + relay reserved",
    )
    for home, side in zip(homes, ("a", "b"), strict=True):
        reach = home.latest()["reach"]
        assert reach["status"] == "private", reach
        assert any(ROUTER_WAN[side] in a for a in reach["observed_addrs"]), reach
        assert "/p2p-circuit/p2p/" in reach["relay"]
    return homes


def _reach(home: Peer) -> dict[str, Any]:
    return dict(home.latest().get("reach", {}))


def _echoed(home: Peer) -> bool:
    return any(v.get("ok") for v in home.latest().get("echo", {}).values())


def _lab_or_skip(random_ports: bool, public_uplink_mbit: int | None = None) -> NatLab:
    why_not = NatLab.available()
    if why_not is not None:
        pytest.skip(f"network namespaces: {why_not}")
    return NatLab(random_ports=random_ports, public_uplink_mbit=public_uplink_mbit)


def test_two_homes_behind_nat_meet_through_a_relay_and_hole_punch_to_direct(tmp_path: Path) -> None:
    peers: list[Peer] = []
    with _lab_or_skip(random_ports=False) as lab:
        try:
            started = time.monotonic()
            homes = _start_homes(lab, tmp_path, peers, "--echo")
            reserved_at = time.monotonic()

            # They meet through the relay; hole punching makes the link direct; a stream works on it.
            def direct(home: Peer) -> bool:
                reach = _reach(home)
                return reach.get("direct_connections") == 2 and reach.get("relayed_connections") == 0

            def done() -> bool:
                punched = sum(_reach(h).get("hole_punches_ok", 0) for h in homes)
                return punched >= 1 and all(direct(h) and _echoed(h) for h in homes)

            _wait(done, DEADLINE, peers, "direct + echo")
            relayed = [h.first(lambda ln: ln["reach"].get("relayed_connections", 0) > 0) for h in homes]
            assert any(r is not None for r in relayed), "the homes never had a relayed connection"
            first_relayed = min(r["t"] for r in relayed if r is not None)
            punched_lines = [
                h.first(
                    lambda ln: (
                        ln["reach"].get("hole_punches_ok", 0) > 0 and ln["reach"]["relayed_connections"] == 0
                    )
                )
                for h in homes
            ]
            direct_at = min(line["t"] for line in punched_lines if line is not None)
            summary = {
                "start_to_relay_reserved_s": round(reserved_at - started, 1),
                "start_to_relayed_link_s": round(first_relayed - started, 1),
                "relayed_to_direct_s_polled": round(direct_at - first_relayed, 2),
                "time_to_direct_s_node": [_reach(h)["time_to_direct_s"] for h in homes],
                "hole_punches_ok_failed": [
                    (_reach(h)["hole_punches_ok"], _reach(h)["hole_punches_failed"]) for h in homes
                ],
                "echo_after_punch": [h.latest()["echo"] for h in homes],
            }
            print("NAT summary:", json.dumps(summary))
        finally:
            for peer in peers:
                peer.stop()


def test_behind_port_randomising_nats_punching_fails_and_the_relay_carries_the_link(tmp_path: Path) -> None:
    peers: list[Peer] = []
    with _lab_or_skip(random_ports=True) as lab:
        try:
            homes = _start_homes(lab, tmp_path, peers, "--echo-relayed")
            _wait(
                lambda: all(_reach(h).get("relayed_connections") == 1 and _echoed(h) for h in homes),
                DEADLINE,
                peers,
                "relayed link + echo",
            )
            # DCUtR's predicted address (the NAT's IP and our listen port) is wrong behind --random: give
            # it its three rounds, then the link must still be relayed, never direct.
            _wait(
                lambda: sum(_reach(h).get("hole_punches_failed", 0) for h in homes) >= 1,
                60,
                peers,
                "a failed hole punch",
            )
            for home in homes:
                reach = _reach(home)
                assert reach["hole_punches_ok"] == 0, reach
                assert reach["relayed_connections"] == 1 and reach["direct_connections"] == 1, reach
            print("NAT --random summary:", json.dumps([_reach(h) for h in homes]))
        finally:
            for peer in peers:
                peer.stop()


def test_two_homes_behind_nat_trade_checkpoint_pieces_directly_after_hole_punching(tmp_path: Path) -> None:
    """The trainer (public, super-seeding, its upload capped at 40 Mbit/s as a trainer's upload is small
    next to the swarm's) shows each home different pieces of a 16 MiB checkpoint, so the homes trade;
    they do, over their hole-punched connection, and no piece byte rides the relay."""
    peers: list[Peer] = []
    with _lab_or_skip(random_ports=False, public_uplink_mbit=40) as lab:
        try:
            origin = Peer(
                [
                    *lab.exec_prefix("pub"),
                    PYTHON,
                    "-m",
                    "tests.p2p.nat_peer",
                    "--listen",
                    f"/ip4/{PUBLIC_IP}/tcp/4001",
                    "--data-dir",
                    str(tmp_path / "origin"),
                    "--share-mib",
                    "16",
                    "--every",
                    "1",
                ],
                tmp_path / "origin.log",
            )
            peers.append(origin)
            _wait(lambda: "shared" in origin.latest().get("swarm", {}), 60, peers, "checkpoint shared")
            identity = origin.identity()
            assert identity is not None
            boot = str(next(a for a in identity["multiaddrs"] if PUBLIC_IP in a))
            fetch = ("--fetch", origin.latest()["swarm"]["shared"], "--trainer", identity["address"])
            homes = [_home(lab, side, boot, tmp_path, "--echo", fetch) for side in ("a", "b")]
            peers += homes
            _wait(
                lambda: all("fetch_s" in h.latest().get("swarm", {}) for h in homes),
                DEADLINE,
                peers,
                "both homes fetched the checkpoint",
            )
            swarms = [h.latest()["swarm"] for h in homes]
            addresses = [str(h.identity()["address"]) for h in homes]  # type: ignore[index]
            by_route: dict[str, int] = {}
            for swarm in swarms:
                for entry in swarm["by_peer"].values():
                    by_route[entry["route"]] = by_route.get(entry["route"], 0) + entry["in"]
            traded = [swarms[0]["by_peer"].get(addresses[1]), swarms[1]["by_peer"].get(addresses[0])]
            summary = {
                "fetch_s": [s["fetch_s"] for s in swarms],
                "dataplane_bytes_in_by_route": by_route,
                "relayed_share": round(by_route.get("relayed", 0) / sum(by_route.values()), 4),
                "home_to_home": traded,
                "time_to_direct_s": [_reach(h).get("time_to_direct_s") for h in homes],
            }
            print("NAT trade summary:", json.dumps(summary))
            for entry in traded:  # at least four 256 KiB pieces each way, over the direct libp2p connection
                assert entry is not None and entry["in"] >= 1 << 20 and entry["route"] == "libp2p", summary
            assert summary["relayed_share"] <= 0.05, summary
        finally:
            for peer in peers:
                peer.stop()
