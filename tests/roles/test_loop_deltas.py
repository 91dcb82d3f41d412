"""Issue 15: the whole loop over real libp2p hosts with policies published as deltas.

The trainer publishes bfloat16 policies at a small learning rate, so consecutive policies differ in a
small share of their values and each step after the first goes out as a delta. The inferer and the
validator rebuild every policy from the one before, verify it against the trainer-signed full manifest,
generate and check rollouts on it, and the trainer trains on the accepted batches: the rebuilt
directories are byte-identical to what the trainer wrote.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import trio

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.ml.checkpoint import step_dir
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.roles.trainer_node import build_trainer_node
from tests.p2p.helpers import make_config, start_node, wait_until
from tests.roles.test_loop_network import RUN_ID, _joiner, warm_model_dir  # noqa: F401  (fixture)

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


@pytest.mark.slow
async def test_policies_travel_as_deltas_and_are_rebuilt_byte_identical_by_inferer_and_validator(
    tmp_path: Path,
    warm_model_dir: Path,  # noqa: F811
) -> None:
    trainer_key, validator_key, inferer_key = (WalletKey.generate() for _ in range(3))
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
            "eval_tasks": 8,
            "learning_rate": 1e-5,
            "publish_dtype": "bfloat16",
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
            swarms = {}
            for index, (key, role) in enumerate([(validator_key, "validator"), (inferer_key, "inferer")], 1):
                swarm, runner = _joiner(tmp_path, index, key, role, trainer_key.address)
                await start_node(
                    nursery,
                    OPEN,
                    make_config(tmp_path, index, run_id=RUN_ID, bootstrap=boot),
                    key=key,
                    services=[swarm, runner],
                    serve_api=False,
                )
                swarms[role] = swarm
            trainer = parts.trainer
            await wait_until(trainer.done.is_set, timeout=200, step=0.2)
            # the last policy reaches both peers (it is shared after the last step)
            await wait_until(
                lambda: all(swarm.locate(3) is not None for swarm in swarms.values()), timeout=60, step=0.2
            )
            nursery.cancel_scope.cancel()
    parts.trainer.close()

    publishing = trainer.status()["publishing"]
    assert publishing["delta"] >= 1, publishing  # steps 1..3 are not snapshot steps
    assert publishing["wire_bytes_ratio"] < 1.0
    assert trainer.step == 3 and trainer.batches_trained >= 2
    policies = tmp_path / "trainer-out" / "policies"
    for role, swarm in swarms.items():
        assert swarm.status()["reconstructions"] >= 1, role
        assert swarm.status()["bad_deltas"] == 0, role
        for step in (1, 2, 3):
            held = swarm.locate(step)
            if held is not None:  # retention may have dropped the oldest
                assert _same_files(held, step_dir(policies, step)), (role, step)
