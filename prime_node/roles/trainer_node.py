"""The networked trainer node (``prime-node run-trainer`` without ``--local``): services and lifecycle.

Services, in start order: the weight swarm (origin of every policy), the run announcer (the signed
run config on topic ``run``), admission (batches with an accepting quorum of trusted verdicts) and the
trainer itself, which reports ready once the starting policy is shared. The process prints one JSON
line with its address and multiaddrs (what inferers bootstrap from), then one per step; it runs until
SIGINT/SIGTERM, or until ``max_steps`` with ``exit_when_done``.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.errors import first_node_error
from prime_node.node_config import NodeConfig


@dataclass
class TrainerNode:
    """The four services of a trainer node, built from its configs (usable in tests without a process)."""

    swarm: Any
    announcer: Any
    admission: Any
    trainer: Any

    @property
    def services(self) -> list[Any]:
        return [self.swarm, self.announcer, self.admission, self.trainer]


def build_trainer_node(
    node_config: NodeConfig,
    run_config: RunConfig,
    key: WalletKey,
    *,
    dataplane_host: str = "127.0.0.1",
    dataplane_port: int = 0,
    model_dir: Path | None = None,
    on_step: Callable[[Any], None] | None = None,
    stop_when_done: bool = False,
    announce_period: float = 5.0,
) -> TrainerNode:
    from prime_node.roles.announcement import RunAnnouncer
    from prime_node.roles.trainer_service import TrainerService, check_trainer_key
    from prime_node.swarm.service import SwarmService
    from prime_node.verification.admission_service import AdmissionService

    run_config = check_trainer_key(run_config, key)
    swarm = SwarmService(
        key=key,
        run_id=run_config.run_id,
        trainer=key.address,
        store_dir=node_config.data_dir / "swarm",
        dataplane_host=dataplane_host,
        dataplane_port=dataplane_port,
        keep=run_config.async_level + 1,
        follow=False,
    )
    admission = AdmissionService(run_config=run_config)
    trainer = TrainerService(
        key=key,
        run_config=run_config,
        swarm=swarm,
        admission=admission,
        model_dir=model_dir,
        on_step=on_step,
        stop_when_done=stop_when_done,
    )
    announcer = RunAnnouncer(key=key, run_config=trainer.config, period=announce_period)
    return TrainerNode(swarm, announcer, admission, trainer)


def run_trainer_node(
    node_config: NodeConfig,
    parts: TrainerNode,
    key: WalletKey,
    *,
    echo: Callable[[str], None],
    exit_when_done: bool,
) -> None:
    from prime_node.node.runner import _start_watchdog
    from prime_node.node.service import Node
    from prime_node.p2p.libp2p_host import open_libp2p_host

    def open_host(wallet: WalletKey) -> Any:
        return open_libp2p_host(wallet, node_config.listen)

    async def main() -> None:
        node = Node(node_config, key, open_host, services=parts.services)
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

                async def finish() -> None:
                    await parts.trainer.done.wait()
                    for step, accuracy in parts.trainer.held_out:
                        echo(json.dumps({"eval_step": step, "heldout_greedy_accuracy": accuracy}))
                    if exit_when_done:
                        nursery.cancel_scope.cancel()

                nursery.start_soon(finish)
                async for received in signals:
                    echo(f"received {signal.Signals(received).name}, shutting down")
                    _start_watchdog()
                    nursery.cancel_scope.cancel()
                    break
        await trio.to_thread.run_sync(parts.trainer.close)

    try:
        trio.run(main)
    except BaseException as exc:
        found = first_node_error(exc)
        if found is not None:
            raise found from None
        raise
