"""The network checks: bootstrap peers reachable (each, with latency), this machine's reachability (NAT),
clock skew against the peers, and bandwidth to one of them.

``gather_network`` starts a real libp2p host with a throwaway key, dials each ``--bootstrap`` address and
asks it over ``/prime-node/probe/1`` (protocol/probe.py) for its clock, a download and an upload; every
step has a timeout, and anything that goes wrong becomes a fact with its reason, never an exception.
Reachability comes from ``prime_node.p2p.nat`` (AutoNAT-style probes via a peer), imported at run time: a
version without it reports "unknown". The ``check_*`` functions turn the facts into checks.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Final

import trio

from crypto.errors import CryptoError
from crypto.identity import public_key_from_peer_id
from crypto.keys import WalletKey
from prime_node.doctor.model_size import ModelEstimate
from prime_node.doctor.probes import Transfer, probe_clock, probe_download, probe_upload
from prime_node.doctor.report import FAIL, PASS, SKIP, WARN, Check
from prime_node.errors import NodeError
from prime_node.node.clock import NodeClock
from prime_node.p2p.libp2p_host import Libp2pHost, open_libp2p_host, parse_multiaddr
from protocol.envelope import FreshnessWindow
from protocol.probe import ClockEstimate
from protocol.resources import format_mib

log = logging.getLogger(__name__)
MAX_SKEW_MS: Final = FreshnessWindow().max_skew_ms
"""Envelopes stamped further ahead than this are refused (protocol/envelope.py)."""
WARN_SKEW_MS: Final = 2_000
SLOW_FETCH_S: Final = 30 * 60
"""A checkpoint that takes longer than this to fetch at the measured rate is worth a warning."""
NAT_MODULE: Final = "prime_node.p2p.nat"
HOW_TO_BOOTSTRAP: Final = (
    "pass --bootstrap /ip4/<ip>/tcp/<port>/p2p/<peer id> (a running node's multiaddr: its node.json, or "
    "the part after the comma of the run address)"
)
BAD_ADDRESS_FIX: Final = (
    "copy the whole multiaddr, /ip4/<ip>/tcp/<port>/p2p/<peer id>, from the node's node.json or the run "
    "address"
)
UNREACHABLE_FIX: Final = (
    "check that the node at {addr} is running and its TCP port is open to you (firewall: ufw allow "
    "<port>/tcp; behind NAT: port forwarding), or try another --bootstrap"
)


@dataclass
class PeerProbe:
    """What one bootstrap address gave."""

    multiaddr: str
    peer_id: str | None = None
    dial_ms: float | None = None
    error: str | None = None
    reason: str | None = None
    clock: ClockEstimate | None = None
    download: Transfer | None = None
    upload: Transfer | None = None
    probe_error: str | None = None
    """Why the probes (clock, bandwidth) failed on a connected peer."""

    @property
    def connected(self) -> bool:
        return self.error is None and self.peer_id is not None

    @property
    def latency_ms(self) -> float | None:
        """The probe's round trip if it ran, else the dial (TCP + Noise handshake, several round trips)."""
        return float(self.clock.rtt_ms) if self.clock is not None else self.dial_ms

    def to_json(self) -> dict[str, Any]:
        return {
            "multiaddr": self.multiaddr,
            "peer_id": self.peer_id,
            "reachable": self.connected,
            "latency_ms": None if self.latency_ms is None else round(self.latency_ms, 1),
            "dial_ms": None if self.dial_ms is None else round(self.dial_ms, 1),
            "error": self.error,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class ReachabilityFact:
    status: str
    """public, private or unknown."""
    detail: str
    observed_addrs: tuple[str, ...] = ()
    relay: str | None = None


@dataclass
class NetworkFacts:
    given: bool
    """Whether any --bootstrap was given (without one, the network checks are skipped)."""
    peers: list[PeerProbe] = field(default_factory=list)
    host_error: str | None = None
    reachability: ReachabilityFact | None = None


_SHORT_ERRORS: Final = {
    "bad_multiaddr": "not a full /ip4/…/tcp/…/p2p/… multiaddr",
    "bad_peer_id": "invalid peer id",
    "wrong_peer_id": "a node answers there, but with another peer id",
    "dial_failed": "unreachable",
    "dial_timeout": "no answer in time",
}
BAD_PEER_ID_FIX: Final = (
    "the peer id after /p2p/ is not the node's (a character changed or cut off?): copy it again, whole, "
    "from the node's node.json or the run address"
)


def _short(peer_id: str | None) -> str:
    return "?" if peer_id is None else f"…{peer_id[-8:]}"


# -- checks -----------------------------------------------------------------------------------------------


def check_bootstrap(facts: NetworkFacts) -> Check:
    if not facts.given:
        return Check("bootstrap", SKIP, "no --bootstrap given", HOW_TO_BOOTSTRAP)
    if facts.host_error is not None:
        return Check(
            "bootstrap",
            FAIL,
            f"could not start a libp2p host: {facts.host_error}",
            "pass --listen /ip4/0.0.0.0/tcp/0 (any free port)",
        )
    details = {"peers": [p.to_json() for p in facts.peers]}
    parts = [
        f"{_short(p.peer_id)} {p.latency_ms:.0f} ms"
        if p.connected and p.latency_ms is not None
        else f"{p.multiaddr}: {_SHORT_ERRORS.get(p.reason or '', p.error)}"
        for p in facts.peers
    ]
    reachable = sum(p.connected for p in facts.peers)
    value = f"{reachable}/{len(facts.peers)} reachable: {'; '.join(parts)}"
    failed = [p for p in facts.peers if not p.connected]
    if not failed:
        return Check("bootstrap", PASS, value, None, details)
    first = failed[0]
    fixes = {
        "bad_multiaddr": BAD_ADDRESS_FIX,
        "bad_peer_id": BAD_PEER_ID_FIX,
        "wrong_peer_id": BAD_PEER_ID_FIX,
    }
    fix = fixes.get(first.reason or "", UNREACHABLE_FIX.format(addr=first.multiaddr))
    return Check("bootstrap", FAIL, value, fix, details)


def _probed(facts: NetworkFacts) -> tuple[list[PeerProbe], Check | None]:
    """The connected peers, or the check to report for ``name`` when there are none."""
    connected = [p for p in facts.peers if p.connected]
    if not facts.given:
        return [], Check("-", SKIP, "needs --bootstrap", "pass --bootstrap (see the bootstrap check)")
    if not connected:
        return [], Check("-", SKIP, "no bootstrap peer reachable", "fix the bootstrap check first")
    return connected, None


def _named(check: Check, name: str) -> Check:
    return Check(name, check.status, check.value, check.fix, check.details)


def check_clock(facts: NetworkFacts) -> Check:
    connected, skipped = _probed(facts)
    if skipped is not None:
        return _named(skipped, "clock")
    measured = [p for p in connected if p.clock is not None]
    if not measured:
        why = "; ".join(f"{_short(p.peer_id)}: {p.probe_error}" for p in connected)
        return Check(
            "clock",
            WARN,
            f"not measured ({why})",
            "the bootstrap node may run an older prime-node: try another",
        )
    worst = max(measured, key=lambda p: abs(p.clock.skew_ms) if p.clock else 0)
    assert worst.clock is not None
    skew, rtt = worst.clock.skew_ms, worst.clock.rtt_ms
    details = {
        "skew_ms": skew,
        "uncertainty_ms": rtt // 2 + 1,
        "max_skew_ms": MAX_SKEW_MS,
        "peers": {p.peer_id: p.clock.skew_ms for p in measured if p.clock is not None},
    }
    value = f"peer clock {skew:+d} ms from ours (±{rtt // 2 + 1} ms, {_short(worst.peer_id)})"
    sync_fix = "turn on time sync: sudo timedatectl set-ntp true (or install chrony / ntpd)"
    if abs(skew) - rtt / 2 > MAX_SKEW_MS:
        return Check(
            "clock",
            FAIL,
            f"{value}: beyond the {MAX_SKEW_MS // 1000} s signed messages allow, they would be refused",
            sync_fix,
            details,
        )
    if abs(skew) > WARN_SKEW_MS:
        return Check(
            "clock", WARN, f"{value}: within {MAX_SKEW_MS // 1000} s, but drifting", sync_fix, details
        )
    return Check("clock", PASS, value, None, details)


def check_bandwidth(facts: NetworkFacts, model: ModelEstimate) -> Check:
    connected, skipped = _probed(facts)
    if skipped is not None:
        return _named(skipped, "bandwidth")
    measured = [p for p in connected if p.download is not None and p.upload is not None]
    if not measured:
        why = "; ".join(f"{_short(p.peer_id)}: {p.probe_error}" for p in connected)
        return Check(
            "bandwidth",
            WARN,
            f"not measured ({why})",
            "the bootstrap node may run an older prime-node or be busy: try again, or another --bootstrap",
        )
    peer = measured[0]
    assert peer.download is not None and peer.upload is not None
    down, up = peer.download.bytes_per_s, peer.upload.bytes_per_s
    fetch_s = model.checkpoint_bytes / down
    details = {
        "download_bytes_per_s": round(down),
        "upload_bytes_per_s": round(up),
        "probe_bytes": peer.download.bytes,
        "peer_id": peer.peer_id,
        "checkpoint_fetch_s": round(fetch_s, 1),
    }
    value = (
        f"down {down / 1e6:.2f} MB/s, up {up / 1e6:.2f} MB/s with {_short(peer.peer_id)} "
        f"({format_mib(peer.download.bytes / (1 << 20))} each way); one checkpoint "
        f"({format_mib(model.checkpoint_bytes / (1 << 20))}) in ~{_duration(fetch_s)} from one peer"
    )
    if fetch_s > SLOW_FETCH_S:
        return Check(
            "bandwidth",
            WARN,
            value,
            "a wired connection or a closer bootstrap peer helps; the swarm fetches from many peers at once",
            details,
        )
    return Check("bandwidth", PASS, value, None, details)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def check_reachability(facts: NetworkFacts) -> Check:
    _, skipped = _probed(facts)
    if skipped is not None:
        return _named(skipped, "reachability")
    found = facts.reachability or ReachabilityFact("unknown", "not probed")
    details = {
        "reachability": found.status,
        "observed_addrs": list(found.observed_addrs),
        "relay": found.relay,
        "detail": found.detail,
    }
    if found.status == "public":
        return Check(
            "reachability", PASS, f"public: peers can dial this machine ({found.detail})", None, details
        )
    if found.status == "private":
        relay = f"; relayed via {found.relay}" if found.relay else ""
        return Check(
            "reachability",
            WARN,
            f"private (behind NAT or a firewall): peers cannot dial this machine{relay} ({found.detail})",
            "forward the libp2p TCP port on your router and join with --announce /ip4/<public ip>/tcp/<port>",
            details,
        )
    return Check(
        "reachability",
        WARN,
        f"unknown ({found.detail})",
        "if peers cannot reach you: forward the libp2p port and join with --announce "
        "/ip4/<public ip>/tcp/<port>",
        details,
    )


# -- gathering --------------------------------------------------------------------------------------------


def check_peer_id(multiaddr: str) -> None:
    """NodeError ``bad_peer_id`` when the address is whole but the peer id after ``/p2p/`` is not one
    (a changed or missing character), ``bad_multiaddr`` when the address itself is malformed."""
    head, _, peer_id = multiaddr.rpartition("/p2p/")
    if head and peer_id and "/" not in peer_id:
        parse_multiaddr(head, need_peer_id=False)
        try:
            public_key_from_peer_id(peer_id)
        except CryptoError as exc:
            raise NodeError(f"invalid peer id {peer_id[:80]!r}: {exc}", reason="bad_peer_id") from None
    parse_multiaddr(multiaddr, need_peer_id=True)


async def _port_answers(multiaddr: str, timeout: float) -> bool:
    """Whether the address's TCP port accepts a connection (a libp2p dial that failed there met a node
    with another identity: the peer id is wrong, not the address)."""
    parts = multiaddr.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6", "dns", "dns4", "dns6") or parts[3] != "tcp":
        return False
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(parts[2], int(parts[4]))
        await stream.aclose()
    except (OSError, ValueError, trio.TooSlowError):
        return False
    return True


async def _probe_peer(
    host: Libp2pHost, probe: PeerProbe, clock: NodeClock, timeout: float, size: int
) -> None:
    try:
        check_peer_id(probe.multiaddr)
        started = trio.current_time()
        with trio.fail_after(timeout):
            probe.peer_id = await host.connect(probe.multiaddr)
        probe.dial_ms = (trio.current_time() - started) * 1000
    except NodeError as exc:
        probe.error, probe.reason = str(exc), exc.reason
    except trio.TooSlowError:
        probe.error, probe.reason = f"no answer within {timeout:.0f} s", "dial_timeout"
    if probe.reason is not None or probe.peer_id is None:
        if probe.reason in ("dial_failed", "dial_timeout") and await _port_answers(probe.multiaddr, timeout):
            wanted = probe.multiaddr.rpartition("/p2p/")[2]
            probe.error = f"a node answers at this address, but not as peer {wanted[:80]} ({probe.error})"
            probe.reason = "wrong_peer_id"
        return
    try:
        with trio.fail_after(timeout):
            probe.clock = await probe_clock(host, probe.peer_id, clock.wall_ms)
        with trio.fail_after(timeout):
            probe.download = await probe_download(host, probe.peer_id, size)
        with trio.fail_after(timeout):
            probe.upload = await probe_upload(host, probe.peer_id, size)
    except NodeError as exc:
        probe.probe_error = str(exc)
    except trio.TooSlowError:
        probe.probe_error = f"a probe took more than {timeout:.0f} s"


async def _reachability(host: Libp2pHost, peer_id: str, timeout: float) -> ReachabilityFact:
    try:
        nat: Any = importlib.import_module(NAT_MODULE)
    except ImportError as exc:
        return ReachabilityFact("unknown", f"NAT detection is not available in this version ({exc.name})")
    try:
        with trio.fail_after(timeout + 1):
            found = await nat.probe_reachability(host, peer_id, timeout)
        status = str(found.status)
        return ReachabilityFact(
            status if status in ("public", "private") else "unknown",
            str(found.detail)[:300],
            tuple(str(a) for a in found.observed_addrs)[:16],
            None if found.relay is None else str(found.relay),
        )
    except trio.TooSlowError:
        return ReachabilityFact("unknown", f"the reachability probe took more than {timeout:.0f} s")
    except Exception as exc:  # another helper's module: whatever it raises is reported, not fatal
        log.debug("reachability probe failed", exc_info=True)
        return ReachabilityFact(
            "unknown", f"the reachability probe failed: {type(exc).__name__}: {exc}"[:300]
        )


async def _probe_alone(
    facts: NetworkFacts, probe: PeerProbe, listen: str, clock: NodeClock, timeout: float, size: int
) -> None:
    """One address on a host of its own (a throwaway key each): py-libp2p dials every address it knows for
    a peer and remembers failed ones, so two addresses of one peer on one host would blur each other. The
    first address that connects also runs the reachability probe, on its host."""
    try:
        async with open_libp2p_host(WalletKey.generate(), listen) as host:
            await _probe_peer(host, probe, clock, timeout, size)
            if probe.connected and probe.peer_id is not None and facts.reachability is None:
                facts.reachability = ReachabilityFact("unknown", "probing")  # claimed by this task
                facts.reachability = await _reachability(host, probe.peer_id, timeout)
    except NodeError as exc:
        facts.host_error = str(exc)


async def gather_network(bootstrap: list[str], listen: str, timeout: float, probe_bytes: int) -> NetworkFacts:
    """Dial and probe every bootstrap address (in parallel when ``listen`` takes any free port, else one
    after the other on that port), and ask one reachable peer about our reachability."""
    facts = NetworkFacts(given=bool(bootstrap), peers=[PeerProbe(a) for a in bootstrap])
    clock = NodeClock()
    if listen.rstrip("/").endswith("/tcp/0"):
        async with trio.open_nursery() as nursery:
            for probe in facts.peers:
                nursery.start_soon(_probe_alone, facts, probe, listen, clock, timeout, probe_bytes)
    else:
        for probe in facts.peers:
            await _probe_alone(facts, probe, listen, clock, timeout, probe_bytes)
    return facts
