"""One broadcast peer as the product runs it: a full node (libp2p host, DHT, gossip, heartbeats) with the
weight swarm's ``SwarmService`` (prime_node/swarm/service.py), the same objects ``prime-node share`` /
``fetch`` run. Unlike ``fetch``, it keeps seeding after it completes (as a ``join`` node would) and waits
for the harness before it starts, so the benchmark times the transfer and not interpreter start-up.

Lines to the harness (JSON): {"event": "ready", ...} once the node runs (origin: once the checkpoint is
shared; receivers: once the data plane has ``--min-links`` channels or ``--link-wait`` s passed), then
on "go MANIFEST_ID" (stdin) a receiver fetches: {"event": "verified"} when every piece is verified and
stored, {"event": "complete"} when the directory is written; "stop" ends it with {"event": "stats"}.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from peer_io import cpu_seconds, say, stdin_lines  # noqa: E402  (this script's folder)

from crypto.keys import Address, WalletKey  # noqa: E402
from prime_node.cli.network_options import network_config  # noqa: E402
from prime_node.node.service import Node  # noqa: E402
from prime_node.p2p.libp2p_host import open_libp2p_host  # noqa: E402
from prime_node.swarm.service import SwarmService, SwarmSettings  # noqa: E402

DATA_PORT = 7400
POLL = 0.05


async def run(args: argparse.Namespace) -> None:
    key = WalletKey(bytes.fromhex(os.environ[args.key_env]))
    trainer = Address.parse(args.trainer) if args.trainer else key.address
    config = network_config(
        listen=f"/ip4/{args.host}/tcp/4001",
        announce=None,
        bootstrap=[args.bootstrap] if args.bootstrap else None,
        data_dir=Path(args.data_dir),
        api_port=0,
        run="bench",
        heartbeat_interval=args.heartbeat_interval,
        bootstrap_timeout=60.0,
    )
    swarm = SwarmService(
        key=key,
        run_id="bench",
        trainer=trainer,
        store_dir=Path(args.data_dir) / "swarm",
        settings=SwarmSettings(
            dataplane_host=args.host, dataplane_port=DATA_PORT, follow=False, upload=not args.no_upload
        ),
    )
    node = Node(config, key, lambda wallet: open_libp2p_host(wallet, config.listen), services=[swarm])
    stdin = trio.lowlevel.FdStream(os.dup(0))
    lines = stdin_lines(stdin)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        start_cpu = cpu_seconds()
        if args.origin:
            piece_size = args.piece_kib * 1024 if args.piece_kib else None
            manifest = await swarm.share(Path(args.origin), step=1, piece_size=piece_size)
            say(event="ready", manifest_id=manifest.id().hex(), multiaddrs=node.advertised_multiaddrs())
        else:
            with trio.move_on_after(args.link_wait):
                while len(swarm.dataplane.links) < args.min_links:
                    await trio.sleep(POLL)
            say(event="ready", links=len(swarm.dataplane.links))
        mid = b""
        async for line in lines:
            if line.startswith("go"):
                mid = bytes.fromhex(line.split()[1]) if len(line.split()) > 1 else b""
                break
        start_cpu = cpu_seconds()
        went = swarm.clock.now()
        if mid and not args.origin:
            if args.dial_origin:  # one tier: every receiver must reach the origin itself
                host, port = args.dial_origin.rsplit(":", 1)
                swarm.dataplane.dial(trainer, host, int(port))

            async def fetch() -> None:
                nursery.start_soon(watch)
                await swarm.fetch(mid)
                say(event="complete", cpu_s=round(cpu_seconds() - start_cpu, 3))

            async def watch() -> None:
                while True:
                    progress = swarm.progress(mid)
                    if progress is not None and progress[0] == progress[1]:
                        say(event="verified", cpu_s=round(cpu_seconds() - start_cpu, 3))
                        return
                    await trio.sleep(POLL)

            nursery.start_soon(fetch)
        async for line in lines:
            if line == "stop":
                break
        version = swarm.versions.get(mid)
        if version is not None and not version.origin:  # for a stalled fetch: what it waits for
            state = version.transfer.node
            missing = state.full & ~state.have
            extra: dict[str, float | None] = {
                "have": state.have.bit_count(),
                "sessions": len(state.peers),
                "sessions_holding_missing": sum(1 for s in state.peers.values() if s.bits & missing),
                "requests_in_flight": state.picker.outstanding,
            }
        elif version is not None:  # the origin: how super-seeding went
            state = version.transfer.node
            extra = {
                "served": sum(state.served),
                "pieces_served_twice_or_more": sum(1 for n in state.served if n > 1),
                "opened": state.open.bit_count(),
                "opened_unrequested": state.opened_unrequested,
                "opened_unspread": state.opened_unspread,
                "hop_time_s": round(state.hop_time, 3),
                "spread_deadline_s": round(state.spread_deadline(), 3),
                "first_pass_s": None if state.first_pass_at is None else round(state.first_pass_at - went, 2),
            }
        else:
            extra = {}
        say(
            event="stats",
            cpu_s=round(cpu_seconds() - start_cpu, 3),
            bytes_in=swarm.dataplane.bytes_in,
            bytes_out=swarm.dataplane.bytes_out,
            links=len(swarm.dataplane.links),
            **extra,
        )
        nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--key-env", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--trainer")
    parser.add_argument("--bootstrap")
    parser.add_argument("--origin")
    parser.add_argument("--no-upload", action="store_true")
    parser.add_argument("--dial-origin")
    parser.add_argument("--min-links", type=int, default=1)
    parser.add_argument("--link-wait", type=float, default=60.0)
    parser.add_argument("--heartbeat-interval", type=float, default=2.0)
    parser.add_argument("--piece-kib", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    trio.run(run, args)


if __name__ == "__main__":
    main()
