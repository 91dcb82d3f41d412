"""A node left to choose its own role switches when the swarm's demand changes, and then holds it.

Real libp2p hosts on 127.0.0.1, a real tiny model and the real role runner: a trainer, a pinned inferer
and one node with no ``--role``. With an inferer producing and no validator in the swarm, the free node
validates; once a pinned validator joins and the backlog is low, it goes back to inferring after its
dwell time, and does not flap back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.node.service import Node
from prime_node.roles.role_runner import RoleRunner
from prime_node.roles.trainer_node import build_trainer_node
from tests.p2p.helpers import make_config, start_node, wait_until
from tests.roles.test_loop_network import OPEN, RUN_ID, _joiner, warm_model_dir  # noqa: F401

DWELL_S = 3.0


@pytest.mark.slow
async def test_a_free_node_validates_when_nobody_does_and_infers_once_a_validator_joins(
    tmp_path: Path,
    warm_model_dir: Path,  # noqa: F811
) -> None:
    trainer_key, inferer_key, free_key, validator_key = (WalletKey.generate() for _ in range(4))
    run = RunConfig.model_validate(
        {
            "run_id": RUN_ID,
            "model_dir": str(warm_model_dir),
            "output_dir": str(tmp_path / "trainer-out"),
            "trainer_address": str(trainer_key.address),
            "trusted_validators": [str(free_key.address), str(validator_key.address)],
            "group_size": 4,
            "prompts_per_step": 4,
            "max_new_tokens": 6,
            "temperature": 1.0,
            "async_level": 2,
            "max_steps": 1000,
            "eval_tasks": 16,
            "eval_every": 1000,
        }
    )
    node_config = make_config(tmp_path, 0, run_id=RUN_ID)
    parts = build_trainer_node(node_config, run, trainer_key, announce_period=1.0)
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            trainer_node, _ = await start_node(
                nursery, OPEN, node_config, key=trainer_key, services=parts.services, serve_api=False
            )
            boot = (trainer_node.advertised_multiaddrs()[0],)

            nodes: dict[int, Node] = {}

            async def join(index: int, key: WalletKey, role: str | None) -> RoleRunner:
                swarm, runner = _joiner(tmp_path, index, key, role or "auto", trainer_key.address)
                runner.min_dwell_s = DWELL_S
                nodes[index], _ = await start_node(
                    nursery,
                    OPEN,
                    make_config(tmp_path, index, run_id=RUN_ID, bootstrap=boot),
                    key=key,
                    services=[swarm, runner],
                    serve_api=False,
                )
                return runner

            await join(1, inferer_key, "inferer")
            free = await join(2, free_key, None)
            await wait_until(lambda: free.role == "validator", timeout=150, step=0.2)
            assert "no validator" in free.reason
            assert nodes[2].record().role == "validator"  # the runner reports the role it chose
            # The runner's demand taps and the validator's own handlers hear the topics side by side.
            assert nodes[2].gossip.handler_count("rollouts") == 2
            assert nodes[2].gossip.handler_count("verdicts") == 2
            switches_before = free.switches

            await join(3, validator_key, "validator")
            await wait_until(lambda: free.role == "inferer", timeout=90, step=0.2)
            assert free.switches == switches_before + 1
            assert nodes[2].record().role == "inferer"
            # The validator's subscriptions ended with its role; the runner's and the inferer's remain.
            assert nodes[2].gossip.handler_count("rollouts") == 1
            await wait_until(lambda: nodes[2].gossip.handler_count("verdicts") == 2, timeout=30)
            # It holds the role: no switch back while the demand stays as it is.
            await trio.sleep(2 * DWELL_S)
            assert free.role == "inferer" and free.switches == switches_before + 1
            nursery.cancel_scope.cancel()
    parts.trainer.close()
