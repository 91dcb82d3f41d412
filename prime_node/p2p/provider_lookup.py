"""Run the bounded provider lookup of protocol/provider_lookup.py on py-libp2p 0.8.1's DHT (why not its
own ``find_providers``: that module's doc). The queries are the DHT's GET_PROVIDERS RPC, sent by its
provider store (``_get_providers_from_peer_with_closers``: a private helper of the pinned version, which
checks the records' signatures and answers empty lists on any failure)."""

from __future__ import annotations

import math
from typing import Any

import trio

from protocol.provider_lookup import CLOSEST, ProviderLookup

QUERY_TIMEOUT = 5.0
"""One peer's answer; a peer slower than this counts as knowing nothing."""


async def find_providers(dht: Any, key: bytes, *, want: int) -> list[Any]:
    """Up to ``want`` distinct providers of ``key`` other than us (py-libp2p ``PeerInfo``s): the local
    store's records and those of the peers nearest the key, asked a few at a time."""
    me = dht.host.get_id()
    store = dht.provider_store
    lookup = ProviderLookup(key, me.to_bytes(), want=want)
    infos: dict[bytes, Any] = {}
    by_bytes: dict[bytes, Any] = {}

    def learn_providers(found: list[Any]) -> list[bytes]:
        ids = []
        for info in found:
            raw = info.peer_id.to_bytes()
            infos.setdefault(raw, info)
            ids.append(raw)
        return ids

    def learn_peers(peers: list[Any]) -> list[bytes]:
        ids = []
        for peer in peers:
            raw = peer.to_bytes()
            by_bytes.setdefault(raw, peer)
            ids.append(raw)
        return ids

    lookup.add_providers(learn_providers(store.get_providers(key)))
    seeds = dht.routing_table.find_local_closest_peers(key, CLOSEST) or dht.host.get_connected_peers()
    lookup.add_peers(learn_peers(list(seeds)))
    answers_in, answers_out = trio.open_memory_channel[tuple[bytes, list[Any], list[Any]]](math.inf)

    async def ask(raw: bytes) -> None:
        providers: list[Any] = []
        closer: list[Any] = []
        with trio.move_on_after(QUERY_TIMEOUT):
            providers, closer = await store._get_providers_from_peer_with_closers(by_bytes[raw], key)
        answers_in.send_nowait((raw, providers, closer))

    async with trio.open_nursery() as nursery:
        while not lookup.done:
            for raw in lookup.next_queries():
                nursery.start_soon(ask, raw)
            raw, providers, closer = await answers_out.receive()
            lookup.answered(raw, learn_providers(providers[:want]), learn_peers(closer[:CLOSEST]))
        nursery.cancel_scope.cancel()
    return [infos[raw] for raw in lookup.providers][:want]
