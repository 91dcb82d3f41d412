"""One BitTorrent peer (libtorrent, the ``bench`` extra): what a user would pick instead of the weight swarm,
over the same shaped links. Local peers only: no DHT, LSD, UPnP, NAT-PMP or trackers; the peers to dial are
given on the command line (each dials those listed, PEX tells the rest), TCP only (no uTP, like our data
plane). The seeder is a plain seeder (libtorrent's default; no super-seeding).

Lines to the harness (JSON): {"event": "ready", ...} once the session listens and the torrent is added
(a seeder with ``--make-torrent`` first hashes the directory into a .torrent file, as ``share`` hashes
its manifest), {"event": "complete"} when every piece is hash-checked and written; with ``--wait-go`` it
dials only after reading "go" (stdin). It keeps seeding until "stop" (or EOF): {"event": "stats"}.

    python torrent_peer.py --listen IP:PORT (--seed DIR [--make-torrent OUT --piece-kib K] | --torrent T
        --save DIR) [--torrent T] [--dial IP:PORT ...] [--wait-go]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import libtorrent as lt
from peer_io import cpu_seconds, say  # this script's folder

POLL = 0.05


def make_torrent(directory: Path, out: Path, piece_size: int) -> None:
    """A v1 .torrent of ``directory`` (the SHA-1 piece hashes libtorrent checks every piece against)."""
    creator = lt.create_torrent(lt.list_files(str(directory)), piece_size, flags=lt.create_torrent.v1_only)
    lt.set_piece_hashes(creator, str(directory.parent))
    out.write_bytes(lt.bencode(creator.generate()))


def session(listen: str) -> lt.session:
    return lt.session(
        {
            "listen_interfaces": listen,
            "enable_dht": False,
            "enable_lsd": False,
            "enable_upnp": False,
            "enable_natpmp": False,
            "enable_ip_notifier": False,
            "enable_outgoing_utp": False,
            "enable_incoming_utp": False,
            "dht_bootstrap_nodes": "",
            "alert_mask": 0,
        }
    )


def stdin_reader() -> tuple[threading.Event, threading.Event]:
    """Events set when "go" and "stop" (or EOF) arrive on stdin."""
    go, stop = threading.Event(), threading.Event()

    def read() -> None:
        for line in sys.stdin:
            if line.strip() == "go":
                go.set()
            elif line.strip() == "stop":
                break
        go.set()
        stop.set()

    threading.Thread(target=read, daemon=True).start()
    return go, stop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--seed")
    parser.add_argument("--make-torrent")
    parser.add_argument("--piece-kib", type=int, default=256)
    parser.add_argument("--torrent")
    parser.add_argument("--save")
    parser.add_argument("--dial", nargs="*", default=[])
    parser.add_argument("--wait-go", action="store_true")
    parser.add_argument("--redial", type=float, default=0.0, help="dial again every this many s until done")
    args = parser.parse_args()
    go, stop = stdin_reader()
    start_cpu = cpu_seconds()
    torrent_file = Path(args.make_torrent or args.torrent)
    if args.seed and args.make_torrent:
        make_torrent(Path(args.seed), torrent_file, args.piece_kib * 1024)
    ses = session(args.listen)
    params = lt.add_torrent_params()
    params.ti = lt.torrent_info(str(torrent_file))
    if args.seed:
        params.save_path = str(Path(args.seed).parent)
        params.flags |= lt.torrent_flags.seed_mode  # the files are the ones just hashed: no re-check
    else:
        params.save_path = args.save
        os.makedirs(args.save, exist_ok=True)
    handle = ses.add_torrent(params)
    say(event="ready", info_hash=str(handle.info_hash()), torrent=str(torrent_file))
    if args.wait_go:
        go.wait()
    started = time.monotonic()
    targets = [(peer.rsplit(":", 1)[0], int(peer.rsplit(":", 1)[1])) for peer in args.dial]
    for target in targets:
        handle.connect_peer(target)
    dialed = time.monotonic()
    reported = bool(args.seed)
    while not stop.wait(POLL):
        if args.redial and not reported and time.monotonic() - dialed >= args.redial:
            dialed = time.monotonic()  # peers started after us were not listening yet at the first dial
            for target in targets:
                handle.connect_peer(target)
        if not reported and handle.status().is_seeding:
            reported = True
            say(event="complete", seconds=round(time.monotonic() - started, 3),
                cpu_s=round(cpu_seconds() - start_cpu, 3))  # fmt: skip
    status = handle.status()
    say(
        event="stats",
        cpu_s=round(cpu_seconds() - start_cpu, 3),
        bytes_out=status.total_payload_upload,
        bytes_in=status.total_payload_download,
        complete=status.is_seeding,
        peers=status.num_peers,
    )
    os._exit(0)  # the session's threads need not wind down: the harness only waits for the line above


if __name__ == "__main__":
    main()
