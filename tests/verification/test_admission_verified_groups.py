"""Admission hands the trainer only the groups its trusted validators replayed: the union over the
accepting verdicts, cut out of the batch as whole groups (real nodes on the in-memory network, real
signatures, a real tiny-model batch)."""

from __future__ import annotations

import functools
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import trio

from crypto.digests import blake3
from crypto.keys import WalletKey
from prime_node.testing.adversary import build_scenario
from prime_node.verification.batch_publish import publish_frame
from protocol.rollouts import RolloutBatch
from protocol.verdict import Verdict, seal_verdict
from tests.p2p.helpers import wait_until
from tests.verification.verdict_net import publish_verdict, start_verdict_net


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _accept(batch: RolloutBatch, batch_id: bytes, groups: tuple[int, ...], reward: float) -> Verdict:
    return Verdict(
        run_id=batch.run_id,
        batch_id=batch_id,
        worker=batch.worker,
        policy_step=batch.policy_step,
        batch_counter=batch.batch_counter,
        accepted=True,
        reasons=(),
        rejected_samples=(),
        rewards=(reward,) * (len(groups) * batch.group_size),
        verified_groups=groups,
    )


def _heard(counts: Counter[str], verdicts: int) -> bool:
    return counts["verdicts_trusted"] == verdicts


async def test_the_trainer_gets_the_union_of_the_verified_groups_and_nothing_else(tmp_path: Path) -> None:
    first, second = WalletKey.generate(), WalletKey.generate()
    scenario = build_scenario(
        group_size=2,
        groups=4,
        max_new_tokens=6,
        trusted_validators=(str(first.address), str(second.address)),
        verdict_quorum=2,
    )
    async with trio.open_nursery() as nursery:
        net = await start_verdict_net(nursery, tmp_path, scenario.config, [first, second], scenario.key)
        scenario.now_ms = time.time_ns() // 1_000_000
        batch, empty = scenario.batch(0), scenario.batch(1)
        frames = [scenario.seal(batch), scenario.seal(empty)]
        ids = [blake3(frame) for frame in frames]
        for frame in frames:
            await publish_frame(net.worker, frame)
        votes = [
            (first, _accept(batch, ids[0], (0,), 0.25)),
            (second, _accept(batch, ids[0], (0, 2), 1.0)),  # group 0 twice: the first verdict's rewards
            (first, _accept(empty, ids[1], (), 0.0)),  # an acceptance that vouches for no group
            (second, _accept(empty, ids[1], (), 0.0)),
        ]
        heard = net.admission.reputation.counts
        for number, (key, verdict) in enumerate(votes, start=1):
            node = net.validators[0 if key is first else 1]
            await publish_verdict(node, seal_verdict(key, verdict, now_ms=node.gossip.clock.wall_ms()))
            await wait_until(functools.partial(_heard, heard, number), 30)  # in this order
        with trio.fail_after(30):
            got = await net.admission.next_accepted()
        assert got.batch_id == ids[0] and got.verified_groups == (0, 2) and got.drawn_groups == 4
        assert got.batch.samples == batch.group(0) + batch.group(2)
        assert got.validator_rewards == (0.25, 0.25, 1.0, 1.0)
        await wait_until(lambda: net.admission.stats()["nothing_verified"] == 1, 30)
        stats = net.admission.stats()
        assert stats["accepted"] == 2 and stats["ready"] == 0  # the empty acceptance is never handed out
        assert stats["groups_unverified"] == 2 + 4
        nursery.cancel_scope.cancel()
