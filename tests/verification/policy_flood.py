"""The attack of issue 13 item 4, for the tests and benchmarks/validator_flood.py: one cheap peer gossips
signed rollout frames claiming the policy step after the newest the trainer has announced, five a second.

``future_batch`` is such a batch: the run's shape and temperature, one-token samples, no proofs (nothing
an honest validator would accept, and cheap to make). ``flood`` publishes them from a running node.
``run_demo`` runs ``prime-node demo`` (real processes on 127.0.0.1, real libp2p) with or without an
extra attacker identity joining it from this process, and returns what the run reported.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from crypto.keys import WalletKey
from prime_node.config import RunConfig, load_run_config
from prime_node.node.gossip import Delivered
from prime_node.node.service import Node
from prime_node.node_config import NodeConfig
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.verification.proving import seal_batch
from prime_node.warm_start.process import WarmProcess
from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.rollouts import RolloutBatch, RolloutSample, pack_logprobs, pack_tokens
from protocol.swarm.messages import Announce
from protocol.topics import CHECKPOINTS_TOPIC, ROLLOUTS_TOPIC
from tests import warm_cli

RATE_HZ = 5.0


def future_batch(config: RunConfig, worker: WalletKey, step: int, counter: int) -> RolloutBatch:
    sample = RolloutSample(
        task_id=0,
        seed=counter,
        prompt=pack_tokens([1]),
        completion=pack_tokens([1]),
        logprobs=pack_logprobs([-1.0]),
        finished=False,
        proof=b"",
    )
    return RolloutBatch(
        format_version=1,
        run_id=config.run_id,
        worker=worker.address,
        policy_step=step,
        batch_counter=counter,
        temperature=config.temperature,
        group_size=config.group_size,
        samples=(sample,) * (config.group_size * config.prompts_per_step),
    )


@dataclass
class FloodStats:
    sent: int = 0
    peer_id: str | None = None
    announced: int | None = None
    claimed: list[int] = field(default_factory=list)
    first_sent_at: float | None = None


async def track_announcements(node: Node, stats: FloodStats) -> None:
    """Follow the newest step announced on ``checkpoints`` (anyone may read the trainer's gossip)."""

    async def on_announce(message: Delivered) -> None:
        try:
            step = decode(message.payload, Announce).step
        except ProtocolError:
            return
        stats.announced = max(step, stats.announced or 0)

    async def ignore(message: Delivered) -> None:
        return None

    await node.gossip.subscribe(CHECKPOINTS_TOPIC, on_announce)
    await node.gossip.subscribe(ROLLOUTS_TOPIC, ignore)  # in the topic's mesh, so its frames spread


async def flood(
    node: Node, key: WalletKey, config: RunConfig, stats: FloodStats, *, rate_hz: float = RATE_HZ
) -> None:
    """Publish a frame claiming (newest announced step + 1) every 1/rate_hz seconds, until cancelled."""
    await track_announcements(node, stats)
    stats.peer_id = node.identity.peer_id
    counter = 0
    while True:
        step = (stats.announced or 0) + 1
        frame = seal_batch(key, future_batch(config, key, step, counter), now_ms=node.gossip.clock.wall_ms())
        await node.gossip.publish(ROLLOUTS_TOPIC, encode(frame))
        stats.sent += 1
        stats.claimed.append(step)
        if stats.first_sent_at is None:
            stats.first_sent_at = time.monotonic()
        counter += 1
        await trio.sleep(1 / rate_hz)


def _trainer_multiaddr(workdir: Path) -> str | None:
    try:
        document = json.loads((workdir / "nodes" / "trainer" / "node.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("state") != "running":
        return None
    return next((a for a in document.get("multiaddrs") or [] if isinstance(a, str) and "/p2p/" in a), None)


async def _attack(
    workdir: Path, demo: subprocess.Popen[Any] | WarmProcess, stats: FloodStats, rate_hz: float
) -> None:
    """Join the demo's swarm as a fresh identity once its trainer is up, and flood until the demo ends."""
    while (address := _trainer_multiaddr(workdir)) is None or not (workdir / "run.toml").exists():
        if demo.returncode is not None:
            return
        await trio.sleep(0.25)
    config = load_run_config(workdir / "run.toml", environ={})
    node_config = NodeConfig.model_validate(
        {
            "listen": "/ip4/127.0.0.1/tcp/0",
            "data_dir": workdir / "attacker",
            "run_id": config.run_id,
            "bootstrap": (address,),
        }
    )
    key = WalletKey.generate()
    opener = functools.partial(open_libp2p_host, listen=node_config.listen)
    node = Node(node_config, key, opener, serve_api=False, write_node_file=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        await flood(node, key, config, stats, rate_hz=rate_hz)


async def _run_demo(
    workdir: Path,
    steps: int,
    attack: bool,
    timeout_s: float,
    rate_hz: float,
    adversary: str,
    env: Mapping[str, str],
) -> tuple[int, str, str, FloodStats]:
    command = [
        *(sys.executable, "-m", "prime_node", "demo", "--steps", str(steps), "--inferers", "1"),
        *("--validators", "1", "--adversary", adversary, "--no-tui", "--json"),
        *("--workdir", str(workdir), "--timeout", str(timeout_s)),
    ]
    stats = FloodStats()
    demo = warm_cli.popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env})
    try:
        async with trio.open_nursery() as nursery:
            if attack:
                nursery.start_soon(_attack, workdir, demo, stats, rate_hz)
            # Both pipes to their ends, then the exit status (in a thread: the flood runs meanwhile).
            communicate = functools.partial(demo.communicate, timeout=timeout_s + 60)  # a hang guard
            out, err = await trio.to_thread.run_sync(communicate, abandon_on_cancel=True)  # type: ignore[call-arg, unused-ignore]
            nursery.cancel_scope.cancel()
    finally:
        if demo.returncode is None:  # failed or cancelled: stop the demo (it ends its own processes)
            with contextlib.suppress(ProcessLookupError):
                os.kill(demo.pid, signal.SIGTERM)
    assert demo.returncode is not None
    return demo.returncode, out.decode(), err.decode(), stats


def run_demo(
    workdir: Path,
    *,
    steps: int,
    attack: bool,
    timeout_s: float = 240.0,
    rate_hz: float = RATE_HZ,
    adversary: str = "none",
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run the demo (1 inferer, 1 validator, the cheating inferer ``adversary`` or none), flooding it from
    an extra identity when ``attack``; the summary, the last status of every node and the flood's counts.
    ``env`` is added to the demo's environment."""
    code, out, err, stats = trio.run(
        _run_demo, workdir, steps, attack, timeout_s, rate_hz, adversary, env or {}
    )
    status: dict[str, Any] = {}
    if (workdir / "status.json").exists():
        status = json.loads((workdir / "status.json").read_text())
    summary = json.loads(out) if code == 0 else {}
    return {
        "returncode": code,
        "stderr_tail": err[-3000:],
        "summary": summary,
        "status": status,
        "flood": {
            "sent": stats.sent,
            "claimed_max": max(stats.claimed, default=None),
            "first_sent_at": stats.first_sent_at,
            "peer_id": stats.peer_id,
        },
    }
