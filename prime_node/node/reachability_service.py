"""Keep the node's NAT state current: reachable or not, a relay slot when not, and the hole-punch tally.

Every node runs it. It asks connected peers (bootstrap peers first) to dial it back
(``prime_node.p2p.nat.probe_reachability``), one peer per round, quickly until it has an answer and
every few minutes after. When the answer is "private" it reserves a circuit-relay slot on a connected
peer (``protocol.reachability.RelayPicker``: bootstrap peers first, then its other connected peers when
every bootstrap relay refuses, since a relay's slots can be full or taken by strangers; a refusing relay
rests a minute) so its relayed address goes into its peer record. It confirms the slot every round (a
refresh; a relay may have given it to a member) and reserves again, elsewhere if need be, when the relay
refuses or goes away. The host's DCUtR
upgrades relayed connections by itself; this service only reports them. All of it appears in
``prime-node status`` as the "reachability" section (docs/nat.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import trio

from prime_node.errors import NodeError
from prime_node.node.context import NodeContext
from prime_node.p2p.nat import Reachability, probe_reachability
from protocol.reachability import RelayPicker, Status, combine, probe_order, should_reserve

log = logging.getLogger(__name__)
SECTION = "reachability"
PROBE_TIMEOUT = 15.0
RETRY_INTERVAL = 5.0
"""Seconds between rounds while the status is unknown or no relay could be reserved."""
RECHECK_INTERVAL = 300.0
"""Seconds between rounds once the status is known (and a relay held, if one is needed)."""
MAX_VERDICTS = 8
PROBE_CANDIDATES = 8


def peer_id_of(multiaddr: str) -> str | None:
    """The last ``/p2p/`` component of a multiaddr (None if it has none)."""
    _, found, tail = multiaddr.rpartition("/p2p/")
    return tail.split("/")[0] or None if found else None


class ReachabilityService:
    """The node service (module doc). ``bootstrap``: the node's bootstrap multiaddrs (probed first);
    ``reserve_relay``: reserve a relay slot when private."""

    def __init__(self, bootstrap: Sequence[str] = (), *, reserve_relay: bool = True) -> None:
        self.preferred = [p for p in (peer_id_of(a) for a in bootstrap) if p]
        self.reserve_relay = reserve_relay
        self.status: Status = "unknown"
        self.last: Reachability | None = None
        self.verdicts: dict[str, Status] = {}
        self.failed_in_a_row = 0
        """"private" answers since the last "public" (``protocol.reachability.combine``)."""
        self.relay_addr: str | None = None
        self.relay_peer: str | None = None
        self.picker = RelayPicker()
        self.probes = 0
        self._next_prober = 0
        self._context: NodeContext | None = None
        self._last_probe_at: float | None = None

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._context = context
        context.add_status_section(SECTION, self.section)
        task_status.started()
        while True:
            settled = await self.round(context)
            await trio.sleep(RECHECK_INTERVAL if settled else RETRY_INTERVAL)

    def _candidates(self, context: NodeContext) -> list[str]:
        return probe_order(
            context.host.peer_id, self.preferred, context.host.connected_peers(), PROBE_CANDIDATES
        )

    async def round(self, context: NodeContext) -> bool:
        """One probe and, if needed, one reservation attempt; True when nothing is left to do for now."""
        candidates = self._candidates(context)
        if candidates:
            prober = candidates[self._next_prober % len(candidates)]
            self._next_prober += 1
            result = await probe_reachability(context.host, prober, PROBE_TIMEOUT)
            self.probes += 1
            self.last = result
            self._last_probe_at = context.clock.now()
            if result.status != "unknown":
                self.verdicts[prober] = result.status
                while len(self.verdicts) > MAX_VERDICTS:
                    del self.verdicts[next(iter(self.verdicts))]
                self.failed_in_a_row = self.failed_in_a_row + 1 if result.status == "private" else 0
            dialled_in_by = context.host.nat_counters().dialled_in_by
            self.status = combine(
                self.verdicts.values(), failed_in_a_row=self.failed_in_a_row, dialled_in_by=dialled_in_by
            )
            log.info("reachability via %s: %s (%s)", prober, result.status, result.detail)
        held = context.host.nat_counters().relay_reservations
        if self.relay_peer is not None and self.relay_peer not in held:
            log.info("relay %s is gone; reserving again", self.relay_peer)
            self.relay_peer = self.relay_addr = None
        elif self.relay_peer is not None and self.reserve_relay:
            await self._confirm(context, self.relay_peer)
        if should_reserve(self.status, self.relay_peer is not None, self.reserve_relay):
            await self._reserve(context, candidates)
        needs_relay = should_reserve(self.status, self.relay_peer is not None, self.reserve_relay)
        return self.status != "unknown" and not needs_relay

    async def _confirm(self, context: NodeContext, relay: str) -> None:
        """Refresh the slot we hold; a refusal means we lost it (the relay rests, we reserve again)."""
        try:
            self.relay_addr = await context.host.reserve_relay(relay)
        except NodeError as exc:
            self.picker.failed(relay, context.clock.now())
            log.info("relay %s no longer holds our slot (%s); reserving again", relay, exc)
            self.relay_peer = self.relay_addr = None

    async def _reserve(self, context: NodeContext, candidates: list[str]) -> None:
        """Try the candidates in order (each at most once per round) until one gives us a slot."""
        # Bootstrap peers are the public peers we know of, so they come first; when all of them refuse
        # (full, or filled by strangers) the other connected peers are tried: every node relays by default.
        ordered = [c for c in candidates if c in self.preferred]
        ordered += [c for c in candidates if c not in ordered]
        for _ in ordered:
            now = context.clock.now()
            relay = self.picker.pick(ordered, now)
            if relay is None:
                return
            try:
                self.relay_addr = await context.host.reserve_relay(relay)
            except NodeError as exc:
                self.picker.failed(relay, now)
                log.info("no relay slot on %s: %s", relay, exc)
                continue
            self.picker.succeeded(relay)
            self.relay_peer = relay
            log.info("reserved a relay slot: reachable as %s", self.relay_addr)
            return

    def section(self) -> dict[str, Any]:
        """The "reachability" status section (JSON-ready)."""
        context = self._context
        counters = context.host.nat_counters() if context is not None else None
        last = self.last
        age = None
        if context is not None and self._last_probe_at is not None:
            age = round(context.clock.now() - self._last_probe_at, 1)
        return {
            "status": self.status,
            "detail": last.detail if last else "not probed yet",
            "observed_addrs": list(last.observed_addrs) if last else [],
            "relay": self.relay_addr,
            "relay_reserved": self.relay_peer is not None,
            "relay_serving": counters.relay_serving if counters else False,
            "relay_clients": counters.relay_clients if counters else 0,
            "relay_refusals": counters.relay_refusals if counters else 0,
            "dialled_in_by": counters.dialled_in_by if counters else 0,
            "direct_connections": counters.direct_connections if counters else 0,
            "relayed_connections": counters.relayed_connections if counters else 0,
            "hole_punches_ok": counters.hole_punches_ok if counters else 0,
            "hole_punches_failed": counters.hole_punches_failed if counters else 0,
            "time_to_direct_s": (
                round(counters.last_time_to_direct_s, 2)
                if counters and counters.last_time_to_direct_s is not None
                else None
            ),
            "probes": self.probes,
            "last_probe_age_s": age,
        }
