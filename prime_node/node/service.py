"""The node: one trio nursery running the host, heartbeats, membership, discovery and the status API.
One file because the Node's loops (heartbeats, membership, discovery, bootstrap) share its host,
membership and record, and the I/O-free rules they apply already live in protocol/.

Services get a read-only ``NodeContext`` (prime_node/node/context.py), never the Node: they report what
they hold (status sections, parts of the peer record) and the node reads the reports. The hardware
summary is the caller's to probe (``prime_node.node.runner.local_hardware``); the node does no probing.
``Node.run`` is started with ``nursery.start``; it reports ready once the host listens, its own peer
record is signed and node.json is written, and it stops when its nursery is cancelled (SIGINT/SIGTERM
in the CLI), marking node.json stopped on the way out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Protocol

import trio

from crypto.identity import peer_id_from_public_key
from crypto.keys import WalletKey
from prime_node import __version__
from prime_node.errors import NodeError
from prime_node.node.clock import NodeClock
from prime_node.node.context import NodeContext, NodeIdentity, NodeReports, RecordPart, StatusSection
from prime_node.node.core import NodeCore
from prime_node.node.data_dir_lock import DataDirLock
from prime_node.node.gossip import GossipService
from prime_node.node.metrics import NodeMetrics
from prime_node.node.neighbour_links import NeighbourLinks
from prime_node.node.peers import PeerPolicy
from prime_node.node.status_api import serve_status
from prime_node.node_config import NodeConfig
from prime_node.p2p.interface import P2PHost, PeerAddresses
from prime_node.p2p.local_addresses import interface_ipv4s, without_wildcards
from protocol.membership import Membership, MembershipConfig, PeerState, StateChanged
from protocol.overlay import OverlayConfig
from protocol.peer_record import HardwareSummary, PeerRecord
from protocol.provider_duty import first_decision_due, provides_run
from protocol.record_book import refresh_interval
from protocol.scoring import ScoringConfig

log = logging.getLogger(__name__)
NODE_FILE = "node.json"
BOOTSTRAP_BACKOFF_MAX = 30.0
PROVIDE_REFRESH = 600.0
DIAL_YIELD_DELAY = 3.0

HostOpener = Callable[[WalletKey], AbstractAsyncContextManager[P2PHost]]
UNPROBED = HardwareSummary(cpu_cores=0, ram_mib=0, gpu_count=0, gpu_vram_mib=0)
"""The hardware a node advertises when its caller probed none (tests, benchmarks)."""
__all__ = ["UNPROBED", "Node", "NodeIdentity", "NodeService", "StatusSection"]


class NodeService(Protocol):
    """A role's or a subsystem's work inside a node (the weight swarm, a validator, an inferer...).

    ``Node.run`` starts each service with ``nursery.start(service.run, context)`` once the host, gossip
    and heartbeats are up, so a service may subscribe to topics and open streams at once; it reports ready
    with ``task_status.started()`` and runs until the node's nursery is cancelled. A service shows itself
    in ``prime-node status`` with ``context.add_status_section`` and in the node's peer record with
    ``context.add_record_source``.
    """

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None: ...


class Node:
    def __init__(
        self,
        config: NodeConfig,
        key: WalletKey,
        open_host: HostOpener,
        *,
        scoring: ScoringConfig | None = None,
        write_node_file: bool = True,
        serve_api: bool = True,
        services: Sequence[NodeService] = (),
        hardware: HardwareSummary = UNPROBED,
    ) -> None:
        self.config = config
        self.key = key
        self.open_host = open_host
        self.scoring = scoring or ScoringConfig()
        self.write_node_file = write_node_file
        self.serve_api = serve_api
        self.services = tuple(services)
        self.reports = NodeReports()
        self.identity = NodeIdentity(str(key.address), peer_id_from_public_key(key.public_key))
        self.metrics = NodeMetrics()
        self.membership: Membership[PeerRecord] = Membership(
            MembershipConfig(config.unhealthy_window, config.dead_window, max(120.0, 4 * config.dead_window))
        )
        self.probed_hardware = hardware
        self.api_url: str | None = None
        self.bootstrapped = trio.Event()
        self._last_bootstrap_error = ""
        self._dialing: set[str] = set()
        self._known: set[str] = set()  # peers vouched for at the connection gate (``_update_known_peers``)
        self._host: P2PHost | None = None
        self._clock: NodeClock | None = None
        self._policy: PeerPolicy | None = None
        self._gossip: GossipService | None = None
        self._links: NeighbourLinks | None = None
        self._issued: tuple[object, ...] | None = None  # what the last record we signed said (load aside)
        self._issued_at = 0.0
        self._context: NodeContext | None = None

    # -- accessors for the status API and tests ---------------------------------------------------------

    @property
    def host(self) -> P2PHost:
        if self._host is None:
            raise NodeError("the node is not running", reason="not_running")
        return self._host

    @property
    def gossip(self) -> GossipService:
        if self._gossip is None:
            raise NodeError("the node is not running", reason="not_running")
        return self._gossip

    @property
    def links(self) -> NeighbourLinks:
        """The direct links to our neighbours (heartbeats and the peer records they carry)."""
        if self._links is None:
            raise NodeError("the node is not running", reason="not_running")
        return self._links

    @property
    def policy(self) -> PeerPolicy:
        if self._policy is None:
            raise NodeError("the node is not running", reason="not_running")
        return self._policy

    @property
    def context(self) -> NodeContext:
        """What the node's services get (and what a test drives a service with)."""
        if self._context is None:
            raise NodeError("the node is not running", reason="not_running")
        return self._context

    @property
    def status_sections(self) -> dict[str, StatusSection]:
        return self.reports.status_sections

    @property
    def is_running(self) -> bool:
        return self._host is not None and self._policy is not None

    def now(self) -> float:
        """trio's clock while running (membership times are on it), else 0."""
        return self._clock.now() if self._clock is not None else 0.0

    def peers_in(self, state: PeerState) -> list[str]:
        return self.membership.in_state(state)

    def uptime(self) -> float:
        return self._clock.uptime() if self._clock else 0.0

    def held(self) -> RecordPart:
        """The record's role, hardware, versions, data-plane port and load, as the services report them."""
        own = RecordPart(self.config.role, self.probed_hardware, (), 0, 0)
        return self.reports.record(own)

    @property
    def role(self) -> str:
        return self.held().role or self.config.role

    @property
    def versions_held(self) -> tuple[int, ...]:
        return self.held().versions_held or ()

    @property
    def dataplane_port(self) -> int:
        return self.held().dataplane_port or 0

    def record(self, refresh_s: int = 0) -> PeerRecord:
        held = self.held()
        return PeerRecord(
            address=self.key.address,
            peer_id=self.identity.peer_id,
            role=held.role or self.config.role,
            multiaddrs=tuple(self.advertised_multiaddrs()[:8]),
            hardware=held.hardware or self.probed_hardware,
            versions_held=held.versions_held or (),
            load_percent=held.load_percent or 0,
            software_version=__version__,
            dataplane_port=held.dataplane_port or 0,
            refresh_s=refresh_s,
        )

    def advertised_multiaddrs(self) -> list[str]:
        suffix = f"/p2p/{self.identity.peer_id}"
        if self.config.announce:
            return [a if a.endswith(suffix) else a + suffix for a in self.config.announce]
        addrs = without_wildcards(self.host.listen_multiaddrs(), interface_ipv4s())
        routable = [a for a in addrs if not a.startswith("/ip4/127.")]
        return routable or addrs  # loopback only when that is all this node listens on

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        owned = DataDirLock(self.config.data_dir) if self.write_node_file else contextlib.nullcontext()
        with owned:  # one node per data dir; only its owner writes node.json
            await self._run(task_status)

    async def _run(self, task_status: Any) -> None:
        self._clock = clock = NodeClock()
        try:
            async with self.open_host(self.key) as host, trio.open_nursery() as nursery:
                self._host = host
                self._policy = PeerPolicy(host, clock, self.metrics, nursery, self.scoring)
                core = NodeCore(
                    host, self.key, self.config.run_id, clock, self.metrics, self._policy, nursery
                )
                self._gossip = GossipService(core)
                self._links = NeighbourLinks(
                    core,
                    self.membership,
                    interval=self.config.heartbeat_interval,
                    on_changes=self._log_changes,
                    overlay=OverlayConfig(self.config.neighbours, self.config.max_neighbours),
                )
                self._issue_record()
                self._context = context = NodeContext(
                    key=self.key,
                    identity=self.identity,
                    run_id=self.config.run_id,
                    clock=clock,
                    metrics=self.metrics,
                    policy=self._policy,
                    membership=self.membership,
                    gossip=self._gossip,
                    host=host,
                    reports=self.reports,
                    running=lambda: self.is_running,
                )
                for service in self.services:
                    await nursery.start(service.run, context)
                if self.serve_api:
                    self.api_url = await nursery.start(serve_status, self, self.config.api_port)
                self.metrics.event(
                    clock.uptime(), "start", f"listening on {', '.join(self.advertised_multiaddrs())}"
                )
                nursery.start_soon(self._heartbeat_loop)
                nursery.start_soon(self.links.refill_loop, self._link_candidates)
                nursery.start_soon(self._membership_loop)
                nursery.start_soon(self._discovery_loop)
                for multiaddr in self.config.bootstrap:
                    nursery.start_soon(self._bootstrap_loop, multiaddr)
                if not self.config.bootstrap:
                    self.bootstrapped.set()
                elif self.config.bootstrap_timeout > 0:
                    nursery.start_soon(self._bootstrap_deadline)
                if self.write_node_file:
                    self._write_node_file("running")
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._host = None
            if self.write_node_file:
                self._write_node_file("stopped")  # synchronous: a cancellation cannot interrupt it

    async def _heartbeat_loop(self) -> None:
        """Each interval: re-sign our record if it changed or is due, and keep D neighbours (the links
        themselves send the beats)."""
        while True:
            self._issue_record()
            self.links.maintain(self._link_candidates())
            self.links.check_silence()
            await trio.sleep(self.config.heartbeat_interval)

    def _link_candidates(self) -> list[str]:
        """Whom a neighbour link may be opened to: healthy members, then peers we are connected to."""
        healthy = self.peers_in(PeerState.HEALTHY)
        return healthy + [p for p in self.host.connected_peers() if p not in healthy]

    def _issue_record(self) -> None:
        """Sign a new record when what it says changed (passed on at once) or its refresh is due (passed
        on with the beats). The load figure alone never triggers one: it changes all the time."""
        refresh = refresh_interval(len(self.membership), self.links.book.config)
        record = self.record(refresh_s=round(refresh))
        content = (
            record.role,
            record.multiaddrs,
            record.hardware,
            record.versions_held,
            record.dataplane_port,
        )
        now = self.now()
        changed = content != self._issued
        if changed or now - self._issued_at >= refresh:
            self.links.issue(record, urgent=changed)
            self._issued, self._issued_at = content, now

    def neighbours(self) -> list[str]:
        """Peers we exchange beats with directly (everyone else is known from records)."""
        return self._links.neighbours() if self._links else []

    def latency_ms(self, peer_id: str) -> int | None:
        return self._links.latency_ms.get(peer_id) if self._links else None

    def _dial_in_background(self, peer: PeerAddresses) -> None:
        if peer.peer_id in self._dialing:
            return
        self._dialing.add(peer.peer_id)
        self.gossip.nursery.start_soon(self._dial, peer)

    async def _dial(self, peer: PeerAddresses) -> None:
        """Dial a discovered peer. Of two peers that learn of each other at once, the one with the larger
        peer ID waits first: with one connection allowed per peer, simultaneous dials would close one of
        the two connections and the streams on it."""
        try:
            if self.identity.peer_id > peer.peer_id:
                await trio.sleep(DIAL_YIELD_DELAY)
                if peer.peer_id in self.host.connected_peers():
                    return
            await self.host.connect_peer(peer)
        except NodeError as exc:
            log.debug("dial %s failed: %s", peer.peer_id, exc)
        finally:
            self._dialing.discard(peer.peer_id)

    async def _membership_loop(self) -> None:
        clock = self._clock
        assert clock is not None
        while True:
            await trio.sleep(min(1.0, self.config.heartbeat_interval / 2))
            self._log_changes(self.membership.tick(clock.now()))
            self.gossip.expire()
            self.policy.expire()
            for peer_id in self.host.connected_peers():
                if self.policy.is_banned(peer_id):
                    await self.host.disconnect(peer_id)
            self._update_known_peers()

    def _update_known_peers(self) -> None:
        """Vouch at the connection gate for the peers that earned it — healthy members past probation —
        so a flood of strangers cannot take their slots; a peer that falls back (banned, unhealthy, gone)
        loses it."""
        earned = {
            peer_id
            for peer_id in self.peers_in(PeerState.HEALTHY)
            if not self.policy.is_banned(peer_id) and not self.policy.on_probation(peer_id)
        }
        for peer_id in earned - self._known:
            self.host.mark_known(peer_id)
        for peer_id in self._known - earned:
            self.host.mark_known(peer_id, known=False)
        self._known = earned

    def _log_changes(self, changes: list[StateChanged]) -> None:
        for change in changes:
            before = change.before.value if change.before else "new"
            after = change.after.value if change.after else "forgotten"
            if change.after is None and self._links is not None:
                self._links.forget(change.peer_id)
            self.metrics.event(self.uptime(), "peer", f"{change.peer_id[-8:]} {before} -> {after}")
            log.info("peer %s: %s -> %s", change.peer_id, before, after)

    async def _bootstrap_loop(self, multiaddr: str) -> None:
        """Stay connected to one bootstrap peer while we need it, retrying with exponential backoff.

        A bootstrap is the way in: once this node has all its neighbours elsewhere (the bootstrap was
        full and refused it), it hangs up, so the bootstrap's connection slots stay free for the next
        joiners (never while a link with it is being opened or accepted: ``Overlay.may_leave``); it dials
        again whenever it has fewer neighbours than it wants (a restarted bootstrap is found again this
        way in a small swarm)."""
        backoff = 0.5
        peer_id: str | None = None
        while True:
            links = self.links.neighbours()
            if peer_id is not None and self.links.may_leave(peer_id):
                if peer_id in self.host.connected_peers():
                    await self.host.disconnect(peer_id)
                    self.metrics.event(self.uptime(), "bootstrap", f"left {multiaddr}: neighbours elsewhere")
                    log.info("left bootstrap %s: neighbours elsewhere", multiaddr)
            elif peer_id is None or (
                peer_id not in self.host.connected_peers() and len(links) < self.config.neighbours
            ):
                try:
                    peer_id = await self.host.connect(multiaddr)
                    self.links.maintain([peer_id])
                    self.bootstrapped.set()
                    self.metrics.event(self.uptime(), "bootstrap", f"connected to {multiaddr}")
                    backoff = 0.5
                except NodeError as exc:
                    if exc.reason == "bad_multiaddr":
                        raise
                    self.metrics.count("bootstrap_failures")
                    self._last_bootstrap_error = str(exc)
                    # Before the node is in, the deadline's one error line sums the attempts up: only
                    # the first failure is worth a warning (a typo'd address printed six, issue 36).
                    first = self.metrics.counters.get("bootstrap_failures", 0) <= 1
                    log.log(
                        logging.WARNING if first or self.bootstrapped.is_set() else logging.DEBUG,
                        "bootstrap %s unreachable (retrying in %.1f s): %s",
                        multiaddr,
                        backoff,
                        exc,
                    )
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, BOOTSTRAP_BACKOFF_MAX)
                    continue
            await trio.sleep(max(self.config.heartbeat_interval, 1.0))

    async def _bootstrap_deadline(self) -> None:
        with trio.move_on_after(self.config.bootstrap_timeout):
            await self.bootstrapped.wait()
            return
        attempts = self.metrics.counters.get("bootstrap_failures", 0)
        last = f"; {attempts} attempts, the last: {self._last_bootstrap_error}" if attempts else ""
        raise NodeError(
            f"no bootstrap peer reachable within {self.config.bootstrap_timeout:.0f} s "
            f"({', '.join(self.config.bootstrap)}{last})",
            reason="bootstrap_unreachable",
        )

    async def _discovery_loop(self) -> None:
        """Announce the run in the DHT if we are one of the few members that do, and look up its
        providers while we lack neighbours.

        Records passed along the neighbour links tell a node about everyone else, so the DHT is only the
        way in: lookups run, from one heartbeat interval after the bootstrap answered (its link hands
        over the records first), while the overlay wants more links than the healthy members we know
        could fill, every second at first and backing off to ``discovery_interval`` (60 s) while they
        find no one new. Each asks up to 40 peers (prime_node/p2p/provider_lookup.py):
        DHT queries are the costliest idle traffic a node has. Whether to provide is decided from the
        members we know (protocol/provider_duty.py), first once the links are full (their records have
        arrived) or the members we know stop growing (``first_decision_due``; their count is sampled once
        per round), then every ``PROVIDE_REFRESH`` s.
        """
        run_key = f"/prime-node/run/{self.config.run_id}"
        pause = 1.0
        await self.bootstrapped.wait()
        interval = self.config.heartbeat_interval
        joined = new_member_at = trio.current_time()
        most_members = 0
        decide_at: float | None = None
        while True:
            now = trio.current_time()
            found: list[PeerAddresses] = []
            if decide_at is None:
                known = len(self.membership.members())
                if known > most_members:
                    most_members, new_member_at = known, now
                if first_decision_due(
                    now - joined, now - new_member_at, interval, links_full=self.links.wanted() == 0
                ):
                    decide_at = now
            try:
                if decide_at is not None and now >= decide_at:
                    decide_at = now + PROVIDE_REFRESH
                    members = [m.peer_id for m in self.membership.members() if m.state is not PeerState.DEAD]
                    if provides_run(self.identity.peer_id, members, run_key):
                        await self.host.provide(run_key)
                        self.metrics.count("dht_provides")
                healthy = self.peers_in(PeerState.HEALTHY)
                if now - joined >= interval and self.links.short_of_candidates(healthy):
                    found = await self.host.find_providers(run_key)
                    self.metrics.count("discovery_rounds")
            except NodeError as exc:
                log.debug("discovery round failed: %s", exc)
            connected = set(self.host.connected_peers())
            new = [p for p in found if p.peer_id not in connected and not self.policy.is_banned(p.peer_id)]
            room = min(self.links.wanted(), self.config.max_peers - len(connected))
            for peer in new[: max(0, room)]:
                self._dial_in_background(peer)
            await trio.sleep(pause)
            pause = 1.0 if new else min(pause * 2, self.config.discovery_interval)

    # -- node.json ---------------------------------------------------------------------------------------

    def node_file(self) -> Path:
        return self.config.data_dir / NODE_FILE

    def _write_node_file(self, state: str) -> None:
        document: dict[str, Any] = {
            "state": state,
            "address": self.identity.address,
            "peer_id": self.identity.peer_id,
            "pid": os.getpid(),
            "run": self.config.run_id,
            "role": self.role,
            "api": self.api_url if state == "running" else None,
        }
        if state == "running":
            document["multiaddrs"] = self.advertised_multiaddrs()
        else:
            document["multiaddrs"] = []
        path = self.node_file()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            temporary.write_text(json.dumps(document, indent=2) + "\n")
            os.replace(temporary, path)
        except OSError as exc:
            raise NodeError(f"cannot write {path}: {exc.strerror}", reason="data_dir") from exc
