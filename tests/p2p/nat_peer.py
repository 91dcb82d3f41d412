"""A node for NAT tests: ``python -m tests.p2p.nat_peer --listen ... --bootstrap ...`` (from the repo root).

It runs exactly what ``prime-node join`` runs (``run_node_until_signal``: the reachability service, the
relay and hole punching from the flags), plus an echo protocol, and prints one JSON line every
``--every`` seconds: ``time.monotonic()`` (one clock for every namespace of a machine), the
"reachability" status section and the connected peers. With ``--echo`` it also sends a frame over a
fresh libp2p stream to each non-bootstrap peer once the node has no relayed connection left, and
reports the round trip (the path the data plane's libp2p fallback rides on).

The weight swarm rides along when asked: ``--share-mib N`` makes this node the run's trainer, sharing a
synthetic N MiB checkpoint in 256 KiB pieces (super-seeding: each downloader is shown different pieces,
so downloaders must trade); ``--fetch MANIFEST_ID --trainer ADDRESS`` fetches it once this node has a
direct connection to another non-bootstrap peer and none relayed. The lines then carry the swarm's
status section (bytes per peer and route).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import trio

from crypto.keys import Address, WalletKey
from prime_node.cli.network_options import network_config
from prime_node.errors import NodeError
from prime_node.node.context import NodeContext
from prime_node.node.reachability_service import SECTION, peer_id_of
from prime_node.node.runner import run_node_until_signal
from prime_node.node.service import Node
from prime_node.p2p.interface import FramedStream
from prime_node.swarm.service import SwarmService, SwarmSettings
from prime_node.testing.swarm_fixtures import write_model_dir

ECHO_PROTOCOL = "/prime-node/test-echo/1"


class EchoService:
    """Answers each frame on ``ECHO_PROTOCOL`` with the same frame."""

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        context.host.set_stream_handler(ECHO_PROTOCOL, self._echo)
        task_status.started()
        await trio.sleep_forever()

    async def _echo(self, stream: FramedStream) -> None:
        frame = await stream.receive_frame()
        if frame is not None:
            await stream.send_frame(frame)


async def _echo_once(node: Node, peer: str) -> dict[str, Any]:
    started = trio.current_time()
    try:
        with trio.fail_after(10):
            stream = await node.host.open_stream(peer, ECHO_PROTOCOL)
            await stream.send_frame(b"hello through the NAT")
            ok = await stream.receive_frame() == b"hello through the NAT"
            await stream.close()
    except (NodeError, trio.TooSlowError) as exc:
        return {"ok": False, "error": str(exc)[:200]}
    return {"ok": ok, "ms": round((trio.current_time() - started) * 1000, 1)}


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--bootstrap", action="append", default=[])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--run", default="nattest")
    parser.add_argument("--every", type=float, default=0.25)
    parser.add_argument("--echo", action="store_true", help="echo once no relayed connection is left")
    parser.add_argument(
        "--echo-relayed", action="store_true", help="echo as soon as connected (even relayed)"
    )
    parser.add_argument("--no-hole-punching", action="store_true")
    parser.add_argument("--share-mib", type=int, default=0, help="share a synthetic checkpoint (trainer)")
    parser.add_argument("--fetch", help="manifest id (hex) to fetch once directly connected")
    parser.add_argument("--trainer", help="the run's trainer address (with --fetch)")
    parser.add_argument("--libp2p-debug", action="store_true", help="py-libp2p's relay and swarm logs")
    return parser.parse_args(argv)


def _logging(libp2p_debug: bool) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("prime_node.p2p").setLevel(logging.INFO)
    logging.getLogger("prime_node.node").setLevel(logging.INFO)
    logging.getLogger("prime_node.dataplane").setLevel(logging.INFO)
    logging.getLogger("prime_node.swarm").setLevel(logging.INFO)
    if libp2p_debug:
        # py-libp2p's logger does not propagate (libp2p_build.quiet_libp2p_logs): give its relay parts a
        # handler of their own.
        for name in ("libp2p.relay.circuit_v2", "libp2p.network.swarm", "libp2p.transport.tcp"):
            logger = logging.getLogger(name)
            logger.setLevel(logging.DEBUG)
            logger.addHandler(logging.StreamHandler(sys.stderr))


def _swarm(args: argparse.Namespace, key: WalletKey) -> SwarmService | None:
    if not (args.share_mib or args.fetch):
        return None
    return SwarmService(
        key=key,
        run_id=args.run,
        trainer=key.address if args.share_mib else Address.parse(args.trainer),
        store_dir=Path(args.data_dir) / "swarm",
        settings=SwarmSettings(dataplane_host=args.listen.split("/")[2], follow=False),
    )


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    _logging(args.libp2p_debug)
    config = network_config(
        listen=args.listen,
        announce=None,
        bootstrap=args.bootstrap,
        data_dir=Path(args.data_dir),
        api_port=0,
        run=args.run,
        heartbeat_interval=1.0,
        bootstrap_timeout=60.0,
        hole_punching=not args.no_hole_punching,
    )
    bootstrap_ids = {peer_id_of(a) for a in args.bootstrap}
    echoed: dict[str, dict[str, Any]] = {}
    key = WalletKey.generate()
    swarm = _swarm(args, key)
    transfer: dict[str, Any] = {}

    async def share(service: SwarmService) -> None:
        model = write_model_dir(Path(args.data_dir) / "model", weight_bytes=args.share_mib << 20, shards=4)
        manifest = await service.share(model, step=1, piece_size=256 << 10)
        transfer["shared"] = manifest.id().hex()

    async def fetch(service: SwarmService) -> None:
        started = trio.current_time()
        await service.fetch(bytes.fromhex(args.fetch))
        transfer["fetch_s"] = round(trio.current_time() - started, 2)

    def directly_connected(node: Node, reach: dict[str, Any]) -> bool:
        others = [p for p in node.host.connected_peers() if p not in bootstrap_ids]
        return bool(others) and reach.get("relayed_connections") == 0

    async def report(node: Node) -> None:
        async with trio.open_nursery() as nursery:
            if swarm is not None and args.share_mib:
                nursery.start_soon(share, swarm)
            while True:
                section = node.reports.status_sections.get(SECTION)
                reach = section() if section else {}
                peers = node.host.connected_peers()
                line: dict[str, Any] = {
                    "t": time.monotonic(),
                    "reach": reach,
                    "peers": peers,
                    "advertised": node.advertised_multiaddrs(),
                }
                ready = args.echo_relayed or (args.echo and reach.get("relayed_connections") == 0)
                if ready:
                    for peer in peers:
                        if peer not in bootstrap_ids and not echoed.get(peer, {}).get("ok"):
                            echoed[peer] = await _echo_once(node, peer)
                line["echo"] = echoed
                if swarm is not None:
                    if args.fetch and "fetch_started" not in transfer and directly_connected(node, reach):
                        transfer["fetch_started"] = time.monotonic()
                        nursery.start_soon(fetch, swarm)
                    line["swarm"] = {**transfer, **swarm.status()}
                print(json.dumps(line), flush=True)
                await trio.sleep(args.every)

    run_node_until_signal(
        config,
        key,
        echo=print,
        services=[EchoService(), *([swarm] if swarm is not None else [])],
        body=report,
        print_identity=True,
    )


if __name__ == "__main__":
    main()
