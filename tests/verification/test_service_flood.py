"""One cheap peer must not stall validation (issue 13 item 4): the real ValidatorService and its real
judge (tiny model, real signatures) on the in-memory network under trio's autojump clock, with a trainer
that announces its checkpoints, an honest inferer and an attacker identity."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import trio

from crypto.keys import WalletKey
from prime_node.node.service import Node
from prime_node.testing.memory_network import MemoryNetwork
from prime_node.verification.cheating import Scenario
from prime_node.verification.proving import seal_batch
from prime_node.verification.service import (
    ReputationService,
    ValidatorService,
    ValidatorSettings,
    _Queued,
    publish_batch,
    publish_frame,
)
from protocol.codec import encode
from protocol.rollouts import RolloutBatch
from protocol.scoring import ScoringConfig
from protocol.swarm.messages import Announce
from protocol.topics import CHECKPOINTS_TOPIC
from tests.p2p.helpers import make_config, sees_all, start_node, wait_until
from tests.verification.network_helpers import (
    LENIENT,
    RUN_ID,
    judged,
    locator,
    make_scenario,
    policy_dir,
    virtual_time_stands_still_in_threads,
)
from tests.verification.policy_flood import FloodStats, flood, future_batch


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@dataclass
class Run:
    scenario: Scenario
    trainer: Node
    validator: Node
    service: ValidatorService
    inferer: Node
    attacker: Node
    attacker_key: WalletKey


@asynccontextmanager
async def _run(tmp_path: Path, *, scoring: ScoringConfig | None = None) -> AsyncIterator[Run]:
    """Trainer (announcing step ``current_step``), validator, honest inferer and attacker, all connected."""
    trainer_key, validator_key, attacker_key = (WalletKey.generate() for _ in range(3))
    scenario = make_scenario([validator_key])
    scenario.config = scenario.config.model_copy(update={"trainer_address": str(trainer_key.address)})
    directory = policy_dir(scenario, tmp_path)
    network = MemoryNetwork()
    kwargs: dict[str, object] = {"serve_api": False, "write_node_file": False}
    async with virtual_time_stands_still_in_threads(), trio.open_nursery() as nursery:
        trainer, _ = await start_node(
            nursery,
            network.host,
            make_config(tmp_path, 0, run_id=RUN_ID),
            key=trainer_key,
            services=[ReputationService(run_config=scenario.config)],
            **kwargs,
        )
        boot = (trainer.advertised_multiaddrs()[0],)
        service = ValidatorService(
            key=validator_key,
            run_config=scenario.config,
            locate=locator(scenario, directory),
            current_step=lambda: scenario.current_step,
            reputation=ReputationService(run_config=scenario.config),
            settings=ValidatorSettings(poll_s=0.1),
        )
        assert service.reputation is not None
        validator, _ = await start_node(
            nursery,
            network.host,
            make_config(tmp_path, 1, run_id=RUN_ID, bootstrap=boot),
            key=validator_key,
            services=[service.reputation, service],
            **({**kwargs, "scoring": scoring} if scoring else kwargs),
        )
        inferer, _ = await start_node(
            nursery,
            network.host,
            make_config(tmp_path, 2, run_id=RUN_ID, bootstrap=boot),
            key=scenario.key,
            **kwargs,
        )
        attacker, _ = await start_node(
            nursery,
            network.host,
            make_config(tmp_path, 3, run_id=RUN_ID, bootstrap=boot),
            key=attacker_key,
            **kwargs,
        )
        nodes = [trainer, validator, inferer, attacker]
        await wait_until(lambda: all(sees_all(n, nodes) for n in nodes), timeout=60)
        announce = Announce(manifest_id=b"\x01" * 32, run=RUN_ID, step=scenario.current_step, envelope=b"")
        await trainer.gossip.publish(CHECKPOINTS_TOPIC, encode(announce))
        await trio.sleep(1)  # delivered to every node
        # Load the policy before the timed part: the first batch would otherwise wait for it.
        assert await service.preload(scenario.current_step)
        yield Run(scenario, trainer, validator, service, inferer, attacker, attacker_key)
        nursery.cancel_scope.cancel()


def _honest_batches(scenario: Scenario, count: int) -> list[RolloutBatch]:
    return [scenario.batch(counter) for counter in range(count)]


async def test_honest_batches_keep_being_judged_while_a_peer_floods_future_step_frames(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with _run(tmp_path) as run:
        batches = _honest_batches(run.scenario, 6)
        stats = FloodStats(announced=run.scenario.current_step)
        async with trio.open_nursery() as attack:
            attack.start_soon(flood, run.attacker, run.attacker_key, run.scenario.config, stats)
            await wait_until(lambda: stats.sent >= 5, timeout=5)
            for batch in batches:
                published_at = trio.current_time()
                batch_id = await publish_batch(run.inferer, run.scenario.key, batch)
                # Each honest batch is judged (and accepted) within seconds, not behind 30-s policy waits.
                assert await judged(run.service, batch_id, timeout=5) == ()
                assert trio.current_time() - published_at < 5
                await trio.sleep(2)
            attack.cancel_scope.cancel()
        assert stats.claimed and all(step == run.scenario.current_step + 1 for step in stats.claimed)
        status = run.service.status()
        assert status["accepted"] == len(batches)
        assert status["waiting_for_policy"] >= 1  # the flood waits beside the queue, not in it
        assert status["dropped_waiting"] >= 1  # and only a few of its frames at a time


async def test_a_workers_flood_does_not_delay_another_workers_batch(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _run(tmp_path, scoring=LENIENT) as run:
        honest = _honest_batches(run.scenario, 1)[0]
        # How many batches were already judged when the honest one joined the queues: the flood frames
        # judged before it *arrived* say nothing about fairness (a fast judge finishes several while the
        # honest frame is still on its gossip hops), only those judged between its arrival and its turn.
        judged_at_arrival: list[int] = []
        enqueue = run.service._enqueue

        def spy(item: _Queued) -> None:
            if item.origin == run.scenario.key.address:
                judged_at_arrival.append(len(run.service.recent))
            enqueue(item)

        monkeypatch.setattr(run.service, "_enqueue", spy)
        config, key, step = run.scenario.config, run.attacker_key, run.scenario.current_step
        now = run.attacker.gossip.clock.wall_ms
        flood_frames = [
            encode(seal_batch(key, future_batch(config, key, step, n), now_ms=now())) for n in range(15)
        ]
        flood_ids = [await publish_frame(run.attacker, frame) for frame in flood_frames]
        honest_id = await publish_batch(run.inferer, run.scenario.key, honest)
        await wait_until(
            lambda: {j.batch_id for j in run.service.recent} >= {honest_id, *flood_ids}, timeout=60
        )
        order = [j.batch_id for j in run.service.recent]
        (arrived_after,) = judged_at_arrival
        waited_behind = order[arrived_after : order.index(honest_id)]
        before = sum(1 for batch_id in waited_behind if batch_id in flood_ids)
        # Round-robin over workers: at most the frame in progress and one more of the flooder's go first
        # after the honest batch arrives (first in, first out, it would wait behind all that are queued).
        assert before <= 2, before
        assert len(flood_ids) - arrived_after >= 10  # most of the flood was still queued ahead of it
        assert next(j for j in run.service.recent if j.batch_id == honest_id).accepted


async def test_the_flooding_peer_is_charged_and_banned(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with _run(tmp_path) as run:
        stats = FloodStats(announced=run.scenario.current_step)
        attacker_peer = run.attacker.identity.peer_id
        async with trio.open_nursery() as attack:
            attack.start_soon(flood, run.attacker, run.attacker_key, run.scenario.config, stats)
            # Its frames wait for a step the trainer never publishes; when they expire, it pays for them.
            await wait_until(lambda: run.validator.policy.is_banned(attacker_peer), timeout=90)
            attack.cancel_scope.cancel()
        assert run.validator.policy.scores.offences(attacker_peer).get("bad_data", 0) >= 2
        assert run.service.rejected["future_policy"] >= 2 and run.service.counts["charged"] >= 2
        # Once banned, nothing it sends reaches the check pipeline.
        assert run.service.status()["accepted"] == run.service.status()["validated"] == 0
        honest_id = await publish_batch(run.inferer, run.scenario.key, _honest_batches(run.scenario, 1)[0])
        # The honest batch is still judged and accepted (how fast is the first test's claim).
        assert await judged(run.service, honest_id, timeout=60) == ()


async def test_a_frame_claiming_a_step_far_ahead_is_refused_on_arrival_and_charged(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with _run(tmp_path) as run:
        config, key = run.scenario.config, run.attacker_key
        batch = future_batch(config, key, run.scenario.current_step + 5, 0)
        frame = encode(seal_batch(key, batch, now_ms=run.attacker.gossip.clock.wall_ms()))
        batch_id = await publish_frame(run.attacker, frame)
        assert await judged(run.service, batch_id, timeout=5) == ("future_policy",)
        offences = run.validator.policy.scores.offences(run.attacker.identity.peer_id)
        assert offences.get("bad_data") == 1
        assert run.service.counts["validated"] == 0  # refused before the check pipeline
        assert run.service.status()["waiting_for_policy"] == 0
