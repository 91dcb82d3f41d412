"""A fetcher process for the kill-and-resume test: downloads a checkpoint from an in-process seed through
the real SwarmNode state machines into a PieceStore, slowly, printing each stored piece; then writes the
output directory. Run as: python resume_worker.py SOURCE STORE ENVELOPE TRAINER OUT DELAY"""

from __future__ import annotations

import random
import sys
import time
from collections import deque
from pathlib import Path

from crypto.keys import Address
from prime_node.swarm.checkpoint_pieces import read_piece_from_files
from prime_node.swarm.piece_store import PieceStore
from protocol.codec import decode
from protocol.envelope import Envelope
from protocol.manifest import open_manifest
from protocol.swarm.messages import Piece
from protocol.swarm.swarm_node import Action, Completed, Send, SwarmNode, Upload, Verify


def main() -> None:
    source, root, envelope_path, trainer, out, delay = sys.argv[1:7]
    envelope = decode(Path(envelope_path).read_bytes(), Envelope)
    manifest = open_manifest(envelope, trainer=Address.parse(trainer))
    store = PieceStore.open(Path(root), manifest)
    print(f"have {store.piece_count_held}", flush=True)
    mid, count = manifest.id(), manifest.piece_count
    seed = SwarmNode(mid, count, rng=random.Random(1), have=(1 << count) - 1)
    me = SwarmNode(mid, count, rng=random.Random(2), have=store.have)
    inbox: deque[tuple[str, Action]] = deque()
    inbox.extend(("seed", a) for a in seed.connected("me", 0.0))
    inbox.extend(("me", a) for a in me.connected("seed", 0.0))
    done = me.complete
    while inbox and not done:
        who, action = inbox.popleft()
        if isinstance(action, Send):
            target, other = (me, "seed") if who == "seed" else (seed, "me")
            receiver = "me" if who == "seed" else "seed"
            inbox.extend((receiver, a) for a in target.receive(other, action.message, 0.0))
        elif isinstance(action, Upload):  # the seed sends a piece
            data = read_piece_from_files(Path(source), manifest, action.index)
            inbox.extend(("seed", a) for a in seed.upload_done("me", action.index, 0.0))
            inbox.extend(("me", a) for a in me.receive("seed", Piece(mid, action.index, data), 0.0))
        elif isinstance(action, Verify):
            ok = store.write(action.index, action.data)
            if ok:
                print(f"wrote {action.index}", flush=True)
                time.sleep(float(delay))
            inbox.extend(("me", a) for a in me.piece_checked("seed", action.index, ok, 0.0))
        elif isinstance(action, Completed):
            done = True
    store.materialize(Path(out))
    print("done", flush=True)


if __name__ == "__main__":
    main()
