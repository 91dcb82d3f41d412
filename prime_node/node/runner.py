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
from collections.abc import Callable, Sequence

import trio

from crypto.keys import WalletKey
from prime_node.errors import first_node_error
from prime_node.node.service import Node, NodeService
from prime_node.node_config import NodeConfig

SHUTDOWN_DEADLINE = 5.0


def run_node_until_signal(
    config: NodeConfig,
    key: WalletKey,
    *,
    echo: Callable[[str], None],
    services: Sequence[NodeService] = (),
) -> None:
    from prime_node.p2p.libp2p_host import open_libp2p_host

    def open_host(wallet: WalletKey):  # type: ignore[no-untyped-def]
        return open_libp2p_host(wallet, config.listen)

    async def main() -> None:
        node = Node(config, key, open_host, services=services)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
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


def _start_watchdog() -> None:
    def expire() -> None:
        print(f"error: shutdown took longer than {SHUTDOWN_DEADLINE:.0f} s; exiting", file=sys.stderr)
        os._exit(1)

    timer = threading.Timer(SHUTDOWN_DEADLINE, expire)
    timer.daemon = True
    timer.start()
