"""DHT provider records bounded per IP group, known peers first (policy: protocol/provider_selection.py).

py-libp2p 0.8.1's provider store keeps at most 20 records per key and ignores newcomers once full
(libp2p/kad_dht/provider_store.py ``add_provider``); ADD_PROVIDER only checks that the record names its
sender. So 20 fresh identities that provide a key before the honest nodes do hide them from every lookup
answered by that store. We replace ``add_provider`` on our DHT's store instance with ``ProviderGuard``'s,
which budgets records per IP group (the group of the provider's live connection, which TCP proves, else
of the address it claims) and lets a newcomer from a scarce group displace one from a crowded group.
``ProviderGuard.select`` applies the same bound to lookup results and lists known peers first.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from prime_node.p2p.inbound_gate import KnownPeers
from protocol.connection_admission import ConnectionLimits
from protocol.provider_selection import ProviderCandidate, admit_provider, select_providers

log = logging.getLogger(__name__)
PROVIDERS_PER_GROUP = 8
STORE_CAPACITY = 20  # py-libp2p's BUCKET_SIZE: its store refuses more records per key


class ProviderGuard:
    def __init__(
        self,
        swarm: Any,
        store: Any,
        limits: ConnectionLimits,
        known: KnownPeers,
        *,
        per_group: int = PROVIDERS_PER_GROUP,
    ) -> None:
        self._swarm = swarm
        self._store = store
        self._limits = limits
        self._known = known
        self.per_group = per_group
        self._original_add: Any = None
        self.outcomes: Counter[str] = Counter()

    def install(self) -> None:
        self._original_add = self._store.add_provider
        self._store.add_provider = self.add_provider

    def add_provider(self, key: bytes, provider: Any) -> None:
        """The store's ``add_provider``, with the per-group budget applied first."""
        if provider is None or not getattr(provider, "peer_id", None):
            return
        records = self._store.providers.get(key, {})
        stored = [self.candidate(record.provider_info) for record in records.values()]
        decision = admit_provider(
            stored, self.candidate(provider), capacity=STORE_CAPACITY, per_group=self.per_group
        )
        self.outcomes[decision.reason] += 1
        if not decision.store:
            log.debug("provider record of %s refused: %s", provider.peer_id, decision.reason)
            return
        if decision.evict is not None:
            records.pop(decision.evict, None)
            log.debug("provider record of %s displaced by %s", decision.evict, provider.peer_id)
        self._original_add(key, provider)

    def select(self, infos: list[Any]) -> list[Any]:
        """Lookup results bounded per group, known peers first, then round-robin across groups."""
        by_peer = {str(info.peer_id): info for info in infos}
        candidates = [self.candidate(info) for info in infos]
        chosen = select_providers(candidates, per_group=self.per_group, limit=len(candidates))
        return [by_peer[c.peer_id] for c in chosen]

    def candidate(self, info: Any) -> ProviderCandidate:
        peer_id = str(info.peer_id)
        return ProviderCandidate(peer_id, self._group(info), self._known.has_peer(peer_id))

    def _group(self, info: Any) -> str:
        ip = _connected_ip(self._swarm, info.peer_id) or _claimed_ip(info.addrs)
        return self._limits.group_of(ip) if ip else f"peer:{info.peer_id}"


def _connected_ip(swarm: Any, peer_id: Any) -> str | None:
    try:
        for conn in swarm.get_connections(peer_id):
            remote = conn.muxed_conn.get_remote_address()
            if remote:
                return str(remote[0])
    except Exception:
        log.debug("no remote address for %s", peer_id, exc_info=True)
    return None


def _claimed_ip(addrs: list[Any]) -> str | None:
    for addr in addrs:
        for protocol in ("ip4", "ip6", "dns4", "dns6", "dns"):
            try:
                value = addr.value_for_protocol(protocol)
            except Exception:
                continue
            if value:
                return str(value)
    return None
