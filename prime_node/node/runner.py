"""Run one node in the foreground until SIGINT/SIGTERM, for ``prime-node join``.

Shutdown is bounded: on a signal the node's nursery is cancelled (libp2p closes in well under a second);
if anything hangs, a watchdog ends the process 5 s after the signal so an operator is never stuck.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence

import trio

from crypto.keys import WalletKey
from prime_node.errors import first_node_error
from prime_node.hardware import GpuSelection, probe, to_summary
from prime_node.node.probe_service import ProbeService
from prime_node.node.reachability_service import ReachabilityService
from prime_node.node.service import Node, NodeService
from prime_node.node_config import NodeConfig
from prime_node.p2p.libp2p_host import open_libp2p_host
from protocol.connection_admission import ConnectionLimits
from protocol.peer_record import HardwareSummary

SHUTDOWN_DEADLINE = 5.0


NodeBody = Callable[[Node], Awaitable[None]]


def inbound_limits(config: NodeConfig) -> ConnectionLimits:
    """The connection gate's budgets, with the operator's per-IP bound (pending handshakes scale along)."""
    per_ip = config.max_inbound_per_ip
    return ConnectionLimits(
        established_per_group=per_ip,
        pending_per_group=max(8, per_ip // 2),
        pending_total=max(64, per_ip),
        established_total=max(192, 2 * per_ip),
    )


def local_hardware() -> HardwareSummary:
    """The heartbeat's hardware summary: the probe of all visible GPUs (count, total VRAM), cores, RAM.

    Probed here, by the process that runs the node, so a Node built in a test does no probing."""

    return to_summary(probe(GpuSelection("auto")))


def run_node_until_signal(
    config: NodeConfig,
    key: WalletKey,
    *,
    echo: Callable[[str], None],
    services: Sequence[NodeService] = (),
    body: NodeBody | None = None,
    stop_when_body_returns: bool = False,
    print_identity: bool = True,
) -> None:
    """Run one node (with ``services``) until SIGINT/SIGTERM.

    ``print_identity`` echoes one JSON line with the node's address, multiaddrs and API once it listens
    (what others bootstrap from). ``body`` then runs beside the node (a command's own work: share, fetch,
    report the trainer's evaluations); with ``stop_when_body_returns`` the node stops when it is done.
    """

    def open_host(wallet: WalletKey):  # type: ignore[no-untyped-def]
        return open_libp2p_host(
            wallet,
            config.listen,
            relay_service=config.relay_service,
            hole_punching=config.hole_punching,
            limits=inbound_limits(config),
        )

    # Every node keeps its NAT state current (docs/nat.md); one told its public address needs no relay.
    reachability = ReachabilityService(
        config.bootstrap, reserve_relay=config.hole_punching and not config.announce
    )

    async def main() -> None:
        # Every node answers ``prime-node doctor``'s clock and bandwidth probes (protocol/probe.py).
        node = Node(
            config,
            key,
            open_host,
            services=[*services, ProbeService(), reachability],
            hardware=local_hardware(),
        )
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                if print_identity:
                    echo(
                        json.dumps(
                            {
                                "address": node.identity.address,
                                "peer_id": node.identity.peer_id,
                                "multiaddrs": node.advertised_multiaddrs(),
                                "api": node.api_url,
                                "node_file": str(node.node_file()),
                            }
                        )
                    )
                if body is not None:
                    nursery.start_soon(_run_body, body, node, nursery.cancel_scope, stop_when_body_returns)
                async for received in signals:
                    echo(f"received {signal.Signals(received).name}, shutting down")
                    _start_watchdog()
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(main)
    except BaseException as exc:
        found = first_node_error(exc)
        if found is not None:
            raise found from None
        raise


async def _run_body(body: NodeBody, node: Node, scope: trio.CancelScope, stop_after: bool) -> None:
    await body(node)
    if stop_after:
        scope.cancel()


def _start_watchdog() -> None:
    def expire() -> None:
        print(f"error: shutdown took longer than {SHUTDOWN_DEADLINE:.0f} s; exiting", file=sys.stderr)
        os._exit(1)

    timer = threading.Timer(SHUTDOWN_DEADLINE, expire)
    timer.daemon = True
    timer.start()
