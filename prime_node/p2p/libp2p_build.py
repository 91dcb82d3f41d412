"""Building a py-libp2p host the way DESIGN §11 says it must be built: Noise only, yamux only, one
connection per peer, our inbound gate and provider guard installed, gossipsub tuned away from its
defaults, a server-mode DHT and circuit relay v2 with hole punching. ``open_libp2p_host`` runs what this
builds."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from crypto.keys import WalletKey
from prime_node.p2p.inbound_gate import InboundGate, KnownPeers, relax_dial_backoff
from prime_node.p2p.libp2p_exits import short
from prime_node.p2p.nat_relay import RelayParts, build_relay_parts
from prime_node.p2p.port_check import ensure_port_free
from prime_node.p2p.provider_guard import ProviderGuard
from prime_node.p2p.yamux_tuning import credit_per_half_window, tune_yamux, whole_writes
from protocol.connection_admission import ConnectionLimits
from protocol.relay_reservations import ReservationLimits

log = logging.getLogger(__name__)
GOSSIPSUB_PROTOCOL = "/meshsub/1.1.0"
NEVER_TRIM = 10.0**9
GOSSIP_PRUNE_BACKOFF = 10
# A GRAFT this soon after a PRUNE is a flood. py-libp2p's default equals the backoff it announces in that
# PRUNE, but the pruned peer rounds the backoff down to whole seconds and grafts again up to 1 s early, so
# honest peers were "flooding" each other: each GRAFT refused, penalised and answered with a PRUNE that
# restarted the cycle (~2.5 GRAFT/PRUNE per second per node in an idle 16-node swarm).
GOSSIP_GRAFT_FLOOD_THRESHOLD = GOSSIP_PRUNE_BACKOFF - 2.0


def quiet_libp2p_logs() -> None:
    """py-libp2p logs routine peer churn at ERROR; keep it out of the user's terminal.

    Call after importing libp2p: its import configures the ``libp2p`` logger (no propagation, no
    handler, so Python's last-resort handler would print bare lines to stderr).
    """
    import libp2p  # noqa: F401  (its import resets the logger we adjust here)

    if not logging.getLogger("prime_node").isEnabledFor(logging.DEBUG):
        for name in ("libp2p", "multiaddr"):
            logger = logging.getLogger(name)
            logger.setLevel(logging.CRITICAL)
            if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
                logger.addHandler(logging.NullHandler())


def gossipsub_router(heartbeat_interval: int) -> Any:
    from libp2p.custom_types import TProtocol
    from libp2p.pubsub.gossipsub import GossipSub

    router = GossipSub(
        protocols=[TProtocol(GOSSIPSUB_PROTOCOL)],
        degree=6,
        degree_low=4,
        degree_high=12,
        heartbeat_interval=heartbeat_interval,
        prune_back_off=GOSSIP_PRUNE_BACKOFF,
        max_messages_per_topic_per_second=1000.0,
        # Its "v2.0" extras measure IP diversity and adapt degrees; with peers that share an IP (one machine,
        # one data centre, loopback) they shrink meshes and heartbeats go missing. Off: our own scoring rules.
        adaptive_gossip_enabled=False,
        eclipse_protection_enabled=False,
    )
    router.graft_flood_threshold = GOSSIP_GRAFT_FLOOD_THRESHOLD
    # Its peer scorer with default parameters scores every peer 0 and gates nothing (thresholds -inf,
    # weights 0); what it does do is "opportunistic grafting" on every heartbeat: 2 more peers per topic
    # whenever they score >= half the mesh median (0 >= 0), so meshes grow past degree_high each few
    # seconds and are pruned back: endless GRAFT/PRUNE traffic in an idle swarm. Misbehaviour is scored by
    # our own peer policy; with no scorer its mesh upkeep is the plain gossipsub one.
    router.scorer = None
    return router


def refuse_a_port_in_use(listen_addr: Any) -> None:
    """py-libp2p's listener sets SO_REUSEPORT, so a second node would bind a port in use and share it
    (``port_check``): refuse that before the host starts."""
    for protocol in ("ip4", "ip6"):
        try:
            host = listen_addr.value_for_protocol(protocol)
            port = int(listen_addr.value_for_protocol("tcp"))
        except Exception:
            continue
        ensure_port_free(host, port)
        return


def why_bind_fails(listen_addr: Any) -> str:
    """Reproduce the bind py-libp2p attempted, to tell the user why it failed."""
    try:
        host = listen_addr.value_for_protocol("ip4")
        port = int(listen_addr.value_for_protocol("tcp"))
        with socket.socket() as probe:
            probe.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    except Exception:
        return "the address cannot be bound"
    return "the transport refused it"


def _resource_manager() -> Any:
    """py-libp2p's resource manager without its global circuit breaker and load shedding: after five
    failures anywhere (routine churn) the breaker refuses every new connection for 60 s, which stalls
    discovery. Stream, connection and memory limits stay on; our own scoring handles abusive peers."""
    from libp2p.rcmgr.manager import ResourceManager

    return ResourceManager(enable_circuit_breaker=False, enable_graceful_degradation=False)


@dataclass(frozen=True)
class HostParts:
    """What ``build_host`` made: py-libp2p's host and services, and our guards installed on them."""

    host: Any
    pubsub: Any
    gossipsub: Any
    dht: Any
    known: KnownPeers
    gate: InboundGate
    guard: ProviderGuard
    relay: RelayParts


def build_host(
    key: WalletKey,
    listen_addr: Any,
    gossip_heartbeat_interval: int,
    limits: ConnectionLimits,
    *,
    relay_service: bool = False,
    hole_punching: bool = True,
    relay_reservations: ReservationLimits | None = None,
) -> HostParts:
    """The host (Noise only, yamux only, one connection per peer) behind our inbound gate, pubsub,
    gossipsub, a server-mode DHT whose provider store is budgeted per IP group, and circuit relay v2 (a
    relay for others if ``relay_service``) with DCUtR hole punching if ``hole_punching``."""
    from libp2p import create_yamux_muxer_option, new_host
    from libp2p.crypto.secp256k1 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
    from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
    from libp2p.network.config import ConnectionConfig
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport

    from prime_node.p2p.gossip_router import LeanPubsub

    # yamux closer to go-yamux (prime_node/p2p/yamux_tuning.py): fewer window updates, and a message is
    # written whole or its stream ends.
    if tune_yamux(os.environ):
        credit_per_half_window()
    whole_writes()
    key_pair = create_new_key_pair(key.secret)
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt=create_yamux_muxer_option(),
        # One connection per peer keeps dials fast (no 250 ms wait for extra connections). When two peers
        # dial each other at once, py-libp2p later "trims" one connection and resets every stream on it;
        # an endless grace period turns that off (at worst a pair keeps two connections).
        connection_config=ConnectionConfig(
            max_connections_per_peer=1,
            grace_period=NEVER_TRIM,
            inbound_upgrade_timeout=limits.handshake_timeout,
        ),
        listen_addrs=[listen_addr],
        resource_manager=_resource_manager(),
    )
    swarm = host.get_network()
    known = KnownPeers()
    gate = InboundGate(swarm, limits, known)
    gate.install()
    relax_dial_backoff(swarm)
    _contain_stream_failures(host)
    gossipsub = gossipsub_router(gossip_heartbeat_interval)
    pubsub = LeanPubsub(host, gossipsub)
    dht = KadDHT(host, DHTMode.SERVER)
    guard = ProviderGuard(swarm, dht.provider_store, limits, known)
    guard.install()
    relay = build_relay_parts(
        host,
        relay_service=relay_service,
        hole_punching=hole_punching,
        reservations=relay_reservations,
        is_known=known.has_peer,
        group_of=limits.group_of,
    )
    return HostParts(host, pubsub, gossipsub, dht, known, gate, guard, relay)


def _contain_stream_failures(host: Any) -> None:
    """An error in the handler of one inbound stream ends that stream, not the host. py-libp2p runs every
    handler (its own: identify, DHT, relay, DCUtR, pubsub; and ours) inside the connection's service, so an
    exception a handler lets escape, e.g. on bytes a peer chose, failed the whole host."""
    dispatch = host._swarm_stream_handler

    async def contained(stream: Any) -> None:
        try:
            await dispatch(stream)
        except Exception as exc:
            peer = getattr(getattr(stream, "muxed_conn", None), "peer_id", "?")
            log.info("resetting a stream from %s: its handler failed: %s", peer, short(exc))
            with contextlib.suppress(Exception):
                await stream.reset()

    host.get_network().set_stream_handler(contained)
