"""The networked trainer node (``prime-node run-trainer`` without ``--local``): services and lifecycle.

Services, in start order: the weight swarm (origin of every policy), the run announcer (the signed
run config on topic ``run``), admission (batches with an accepting quorum of trusted verdicts) and the
trainer itself, which reports ready once the starting policy is shared. The process prints one JSON
line with its address and multiaddrs (what inferers bootstrap from), one with the run address joiners
pass as ``join --run`` (``{"join": "RUN@0xTRAINER,MULTIADDR"}``), then one per step; it runs until
SIGINT/SIGTERM, or until ``max_steps`` with ``exit_when_done``. Under torchrun (``--nproc N``) this is
rank 0 (``dist``); the other ranks only train (``prime_node/roles/trainer_ranks.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.node_config import NodeConfig
from prime_node.roles.announcement import RunAnnouncer
from prime_node.roles.trainer_key import check_trainer_key
from prime_node.roles.trainer_service import TrainerOptions, TrainerService
from prime_node.verification.batch_archive import open_archive
from protocol.run_announcement import MAX_BOOTSTRAP, RunAddress

EVALUATION_POLL_S = 1.0

if TYPE_CHECKING:
    from prime_node.ml.distributed import DistInfo


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
    dist: DistInfo | None = None,
) -> TrainerNode:
    from prime_node.swarm.service import SwarmService, SwarmSettings
    from prime_node.verification.admission_service import AdmissionService
    from prime_node.verification.inbox import IntakeHooks

    run_config = check_trainer_key(run_config, key)
    swarm = SwarmService(
        key=key,
        run_id=run_config.run_id,
        trainer=key.address,
        store_dir=node_config.data_dir / "swarm",
        settings=SwarmSettings(
            dataplane_host=dataplane_host,
            dataplane_port=dataplane_port,
            keep=run_config.async_level + 1,
            follow=False,
        ),
    )
    archive = open_archive(
        node_config,
        policy_roots=(run_config.output_dir / "policies", node_config.data_dir / "swarm" / "checkpoints"),
        run_config=run_config,
    )
    admission = AdmissionService(
        run_config=run_config,
        newest_step=lambda: trainer.step,  # the trainer's own step: a claim past it is certain to be bad
        hooks=IntakeHooks(archive=archive),
    )
    trainer = TrainerService(
        key=key,
        run_config=run_config,
        swarm=swarm,
        admission=admission,
        options=TrainerOptions(model_dir=model_dir, stop_when_done=stop_when_done, dist=dist),
        on_step=on_step,
    )
    announcer = RunAnnouncer(key=key, run_config=trainer.config, period=announce_period)
    return TrainerNode(swarm, announcer, admission, trainer)


def step_line(metrics: Any) -> str:
    """The JSON line the trainer prints after each step."""
    return json.dumps(
        {
            "step": metrics.step,
            "policy_step": metrics.policy_step,
            "reward": round(metrics.reward_mean, 4),
            "groups_kept": metrics.groups_kept,
            "loss": round(metrics.loss, 5),
            "grad_norm": round(metrics.grad_norm, 4),
        }
    )


async def echo_evaluations(trainer: Any, echo: Callable[[str], None]) -> None:
    """One JSON line per held-out evaluation as it lands (they used to come all together after the last
    step), until the trainer is done; its final evaluation lands before ``done`` is set."""
    said = 0
    while True:
        done = trainer.done.is_set()
        evaluations = trainer.held_out[said:]
        for step, accuracy in evaluations:
            echo(json.dumps({"eval_step": step, "heldout_greedy_accuracy": accuracy}))
        said += len(evaluations)
        if done:
            return
        with trio.move_on_after(EVALUATION_POLL_S):
            await trainer.done.wait()


def run_trainer_node(
    node_config: NodeConfig,
    parts: TrainerNode,
    key: WalletKey,
    *,
    echo: Callable[[str], None],
    exit_when_done: bool,
) -> None:
    from prime_node.node.runner import run_node_until_signal

    async def report_evaluations(node: Any) -> None:
        # What joiners paste as `join --run`: the run id pinned to this key, with bootstrap addresses.
        bootstrap = tuple(node.advertised_multiaddrs()[:MAX_BOOTSTRAP])
        echo(json.dumps({"join": str(RunAddress(node_config.run_id, key.address, bootstrap))}))
        await echo_evaluations(parts.trainer, echo)

    try:
        run_node_until_signal(
            node_config,
            key,
            echo=echo,
            services=parts.services,
            body=report_evaluations,
            stop_when_body_returns=exit_when_done,
        )
    finally:
        parts.trainer.close()
