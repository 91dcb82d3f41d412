"""One broadcast peer with a fixed neighbour list: the swarm's own pieces (SwarmNode via CheckpointTransfer,
PieceStore on disk, the wallet-authenticated data plane of prime_node/swarm/transport.py), without the
libp2p control plane. The harness (benchmarks/broadcast.py) hands it the manifest and every peer's
address, so the measurement is the piece exchange over the shaped links and nothing else.

Protocol with the harness, one JSON object per line: this process prints {"event": "ready"} once it
listens, starts dialing when it reads "go" on stdin, prints {"event": "complete", ...} when every piece is
verified and stored, keeps serving, and prints {"event": "stats", ...} and exits on "stop" (or EOF).

    python direct_peer.py --manifest M --key-env VAR --listen IP:PORT --peers PEERS.json
        (--origin DIR | --store DIR) [--no-upload] [--dial-below INDEX]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import sys
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from peer_io import cpu_seconds, say, stdin_lines  # noqa: E402  (this script's folder)

from crypto.keys import Address, WalletKey  # noqa: E402
from prime_node.swarm.piece_store import PieceStore  # noqa: E402
from prime_node.swarm.transfer import CheckpointTransfer, OriginDirectory, PieceSource  # noqa: E402
from prime_node.swarm.transport import DataPlane  # noqa: E402
from protocol.codec import decode  # noqa: E402
from protocol.manifest import Manifest  # noqa: E402
from protocol.swarm.swarm_node import SwarmConfig  # noqa: E402

TICK = 0.5


async def run(args: argparse.Namespace) -> None:
    key = WalletKey(bytes.fromhex(os.environ[args.key_env]))
    manifest = decode(Path(args.manifest).read_bytes(), Manifest)
    peers = json.loads(Path(args.peers).read_text())
    host, port = args.listen.rsplit(":", 1)
    pieces: PieceSource
    store: PieceStore | None = None
    if args.origin:
        pieces = OriginDirectory(Path(args.origin), manifest)
    else:
        store = PieceStore.open(Path(args.store), manifest)
        pieces = store
    config = SwarmConfig(super_seed=bool(args.origin) and not args.no_super_seed)
    completed_at: list[float] = []
    start_cpu = cpu_seconds()

    def on_complete() -> None:
        completed_at.append(trio.current_time())
        say(event="complete", cpu_s=round(cpu_seconds() - start_cpu, 3))

    plane: DataPlane

    def send(peer: Any, frame: bytes) -> None:
        plane.send(peer, frame)

    def close(peer: Any, reason: str) -> None:
        plane.close(peer)

    transfer = CheckpointTransfer(
        manifest,
        pieces,
        send=send,
        close=close,
        rng=random.Random(key.address.raw),
        config=config,
        on_complete=on_complete,
        upload=not args.no_upload,
    )
    plane = DataPlane(
        key,
        on_up=lambda peer: transfer.connected(peer, trio.current_time()),
        on_frame=lambda peer, frame: transfer.frame(peer, frame, trio.current_time()),
        on_down=lambda peer: transfer.disconnected(peer, trio.current_time()),
    )
    stdin = trio.lowlevel.FdStream(os.dup(0))
    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run, host, int(port))
        say(event="ready")
        lines = stdin_lines(stdin)
        async for line in lines:
            if line == "go":
                break
        for entry in peers:
            if entry["index"] < args.dial_below:
                plane.dial(Address.parse(entry["address"]), entry["host"], int(entry["port"]))

        async def ticker() -> None:
            while True:
                await trio.sleep(TICK)
                transfer.tick(trio.current_time())

        nursery.start_soon(ticker)
        async for line in lines:
            if line == "stop":
                break
        say(
            event="stats",
            cpu_s=round(cpu_seconds() - start_cpu, 3),
            bytes_in=transfer.bytes_in,
            bytes_out=transfer.bytes_out,
            complete=transfer.completed,
            max_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        )
        nursery.cancel_scope.cancel()
    if store is not None:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--key-env", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--peers", required=True)
    parser.add_argument("--origin")
    parser.add_argument("--store")
    parser.add_argument("--no-upload", action="store_true")
    parser.add_argument("--no-super-seed", action="store_true")
    parser.add_argument("--dial-below", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    profile = os.environ.get("BROADCAST_PROFILE")
    if profile:  # cProfile of this peer, written to $BROADCAST_PROFILE.<pid> (for finding where CPU goes)
        import cProfile

        cProfile.runctx("trio.run(run, args)", globals(), locals(), f"{profile}.{os.getpid()}")
    else:
        trio.run(run, args)


if __name__ == "__main__":
    main()
