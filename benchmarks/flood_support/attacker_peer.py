"""The never-resolving-announcement attacker of ``benchmarks/validator_flood.py --attack announcements``,
in a process of its own, so that its gossip and channels do not share the validator's GIL (issue 35 item
2: in one process the comparison measured the benchmark's interpreter as much as the validator's
defences). A node with a fresh key joined to the benchmark's swarm on real libp2p (127.0.0.1), with a
data-plane port that accepts the channel and never answers.

Run by the benchmark as ``python benchmarks/flood_support/attacker_peer.py SETTINGS_JSON`` (``bootstrap``,
``run_config``, ``step``, ``data_dir``, ``peers``); JSON lines on stdout, commands on stdin:
- prints ``{"peer_id", "address"}`` once its node runs, then ``{"ready": true}`` once it sees ``peers``
  healthy members;
- ``attack``: gossips 16 announcements of batches at the run's size cap, prints ``{"offered": 16}``, then
  4 more every 2 s;
- ``stop`` (or stdin closed): prints ``{"offers_sent": N, "cpu_s": S}`` and exits.
"""

from __future__ import annotations

import functools
import json
import resource
import sys
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

INITIAL_OFFERS = 16
OFFERS_PER_ROUND = 4
ROUND_S = 2.0


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return round(usage.ru_utime + usage.ru_stime, 2)


async def _stdin_lines() -> Any:
    stdin = trio.lowlevel.FdStream(0)
    buffer = b""
    while True:
        chunk = await stdin.receive_some(4096)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line.decode().strip()


async def main(settings: dict[str, Any]) -> None:
    from crypto.keys import WalletKey
    from prime_node.config import RunConfig
    from prime_node.dataplane.channel import AuthenticatedChannel
    from prime_node.dataplane.connect import serve_channels
    from prime_node.node.service import Node
    from prime_node.p2p.libp2p_host import open_libp2p_host
    from prime_node.verification.batch_publish import ROLLOUTS_TOPIC
    from prime_node.verification.service import ReputationService
    from protocol.codec import encode
    from protocol.membership import PeerState
    from protocol.rollout_transfer import MAX_CHANNEL_FRAME, ROLLOUT_CONTEXT, RolloutAnnouncement
    from tests.p2p.helpers import make_config

    run = RunConfig.model_validate(settings["run_config"])
    config = make_config(
        Path(settings["data_dir"]), 50, run_id=run.run_id, bootstrap=(settings["bootstrap"],)
    )
    key = WalletKey.generate()
    opener = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")
    node = Node(
        config,
        key,
        opener,
        services=[ReputationService(run_config=run)],
        serve_api=False,
        write_node_file=False,
    )
    sent = 0

    async def silent(channel: AuthenticatedChannel) -> None:
        await trio.sleep_forever()

    async def attack(nursery: trio.Nursery) -> None:
        nonlocal sent
        port = await nursery.start(
            functools.partial(
                serve_channels,
                key,
                silent,
                host="127.0.0.1",
                context=ROLLOUT_CONTEXT,
                max_frame=MAX_CHANNEL_FRAME,
            )
        )

        async def offer() -> None:
            nonlocal sent
            announcement = RolloutAnnouncement(
                sent.to_bytes(32, "big"), run.max_rollout_batch_bytes, run.run_id, key.address,
                settings["step"], 10_000 + sent, port,
            )  # fmt: skip
            await node.gossip.publish(ROLLOUTS_TOPIC, encode(announcement))
            sent += 1

        for _ in range(INITIAL_OFFERS):
            await offer()
        _say(offered=INITIAL_OFFERS)
        while True:
            await trio.sleep(ROUND_S)
            for _ in range(OFFERS_PER_ROUND):
                await offer()

    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        _say(peer_id=node.identity.peer_id, address=str(key.address))
        while len(node.peers_in(PeerState.HEALTHY)) < settings["peers"]:
            await trio.sleep(0.1)
        _say(ready=True)
        async for line in _stdin_lines():
            if line == "attack":
                nursery.start_soon(attack, nursery)
            elif line == "stop":
                break
        _say(offers_sent=sent, cpu_s=_cpu_s())
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
