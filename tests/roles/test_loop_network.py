"""The whole RL loop over real libp2p hosts on 127.0.0.1, in one trio process, with a real tiny model.

A trainer node (weight swarm origin, run announcer, admission, GRPO trainer), a validator and an honest
inferer that learn the run from the signed announcement of their pinned trainer, and a cheating
inferer. Checkpoints flow through the weight swarm, batches are validated, and the trainer
advances on accepted batches only: nothing the cheater produced is ever trained on.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import trio

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.hardware import GpuSelection
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.roles.role_runner import RoleRunner, RoleSettings
from prime_node.roles.trainer_node import build_trainer_node
from prime_node.swarm.service import SwarmService, SwarmSettings
from tests.p2p.helpers import make_config, start_node, wait_until

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")
RUN_ID = "looptest"


@pytest.fixture(scope="module")
def warm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's packaged warmed-up tiny model, so sampled rewards differ within groups. Packaged, not
    warmed up here: the same seeded warm-up lands on a different model on another CPU."""
    from prime_node.assets import copy_demo_model

    out = tmp_path_factory.mktemp("warm") / "model"
    copy_demo_model(out)
    return out


def _joiner(
    tmp_path: Path,
    index: int,
    key: WalletKey,
    role: str,
    trainer: Any,
    adversary: str | None = None,
    lines: list[str] | None = None,
) -> tuple[SwarmService, RoleRunner]:
    swarm = SwarmService(
        key=key,
        run_id=RUN_ID,
        trainer=trainer,
        store_dir=tmp_path / f"node{index}" / "swarm",
        settings=SwarmSettings(dataplane_host="127.0.0.1", keep=3),
    )
    runner = RoleRunner(
        key=key,
        run_id=RUN_ID,
        swarm=swarm,
        data_dir=tmp_path / f"node{index}",
        gpus=GpuSelection("none"),
        settings=RoleSettings(
            pinned=role, trainer=trainer, adversary=adversary, interval=0.5, progress_interval_s=1.0
        ),
        notify=None if lines is None else lines.append,
    )
    return swarm, runner


def training_demand_published(node: Any) -> int:
    return int(node.status_sections["training"]()["demand"]["published"])


@pytest.mark.slow
async def test_checkpoints_flow_batches_are_validated_and_only_accepted_ones_are_trained(
    tmp_path: Path, warm_model_dir: Path
) -> None:
    trainer_key, validator_key, honest_key, cheater_key = (WalletKey.generate() for _ in range(4))
    run = RunConfig.model_validate(
        {
            "run_id": RUN_ID,
            "model_dir": str(warm_model_dir),
            "output_dir": str(tmp_path / "trainer-out"),
            "trainer_address": str(trainer_key.address),
            "trusted_validators": [str(validator_key.address)],
            "group_size": 4,
            "prompts_per_step": 4,
            "max_new_tokens": 6,
            "temperature": 1.0,
            "async_level": 2,
            "max_steps": 3,
            "eval_tasks": 16,
            "length_reward": {"coef": 0.5, "target_tokens": 3},
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
            joiners = {}
            honest_lines: list[str] = []  # what the honest contributor's terminal says
            for index, (key, role, pin, adversary) in enumerate(
                [
                    (validator_key, "validator", trainer_key.address, None),
                    (honest_key, "inferer", trainer_key.address, None),
                    (cheater_key, "inferer", trainer_key.address, "tampered_token"),
                ],
                start=1,
            ):
                lines = honest_lines if key is honest_key else None
                swarm, runner = _joiner(tmp_path, index, key, role, pin, adversary, lines)
                node, _ = await start_node(
                    nursery,
                    OPEN,
                    make_config(tmp_path, index, run_id=RUN_ID, bootstrap=boot),
                    key=key,
                    services=[swarm, runner],
                    serve_api=False,
                )
                joiners[role if adversary is None else "cheater"] = (node, swarm, runner)

            trainer = parts.trainer
            await wait_until(trainer.done.is_set, timeout=200, step=0.2)

            validator_node, validator_swarm, _ = joiners["validator"]
            honest_node, honest_swarm, honest_runner = joiners["inferer"]
            cheater_node, _, cheater_runner = joiners["cheater"]
            # the run was learnt from the pinned trainer's announcement
            assert honest_runner.follower.trust.trainer == trainer_key.address
            assert honest_runner.follower.announcement is not None
            assert honest_runner.config is not None and honest_runner.config.max_new_tokens == 6
            # checkpoints flowed through the weight swarm to the workers
            assert trainer.checkpoints_shared >= 3
            newest = honest_swarm.newest()
            assert newest is not None and newest[0] >= 1
            assert validator_swarm.newest() is not None
            # the trainer advanced on accepted batches only, all from the honest worker
            assert trainer.step == 3 and trainer.batches_trained >= 2
            assert set(trainer.by_worker) == {str(honest_key.address)}
            assert str(cheater_key.address) not in parts.admission.accepted_by_worker
            # the cheater's work was produced, published and rejected by the validator
            rollouts = cheater_node.status_sections["rollouts"]()
            assert rollouts["published"] >= 1
            await wait_until(lambda: cheater_node.status_sections["rollouts"]()["rejected"], timeout=60)
            assert "sampling_mismatch" in cheater_node.status_sections["rollouts"]()["rejected"]
            honest = honest_node.status_sections["rollouts"]()
            assert honest["accepted"] >= 2 and not honest["rejected"]
            # the trainer's signed demand reached the workers, who believed it (issue 38)
            assert training_demand_published(trainer_node) >= 1
            assert honest_runner.demand is not None and honest_runner.demand.book.believed >= 1
            assert validator_node.status_sections["demand"]()["heard"] >= 1
            # status sections of every role
            training = trainer_node.status_sections["training"]()
            assert training["step"] == 3 and len(training["reward_curve"]) == 3
            assert training["held_out"] and training["held_out"][-1][0] == 3
            assert validator_node.status_sections["role"]()["role"] == "validator"
            assert validator_node.status_sections["validation"]()["accepted"] >= 2
            assert cheater_runner.status()["role"] == "inferer"
            # the contributor's terminal: the run followed, its rollouts' fate, the run's end, and on stop
            # a summary (issue 36)
            assert any("following trainer" in line for line in honest_lines)
            assert not any(line.startswith("seeder") for line in honest_lines)  # "inferer (starting)"
            await wait_until(lambda: "the run has ended" in honest_lines[-1], timeout=60)
            assert honest_lines[-1].startswith("inferer · policy 3/3 · rollouts: ")
            said = re.search(r"(\d+) published, (\d+) accepted, 0 rejected", honest_lines[-1])
            assert said is not None and int(said[2]) >= 2, honest_lines[-1]
            nursery.cancel_scope.cancel()
    parts.trainer.close()
    assert honest_lines[-1].startswith("stopped after ") and "as inferer" in honest_lines[-1]
    assert "accepted by validators" in honest_lines[-1] and "the run had ended" in honest_lines[-1]
    checkpoints = sorted(p.name for p in (tmp_path / "trainer-out" / "checkpoints").iterdir())
    assert "step_00000003" in checkpoints
    assert (tmp_path / "trainer-out" / "rollouts.log").stat().st_size > 0
