"""Rollout batches over the data plane (docs/verification.md, *Rollout batches over the data plane*), on
real libp2p hosts and real data-plane channels on 127.0.0.1 with a real tiny model.

A batch of ~10 MiB (4,096 samples of up to 400 tokens, sampled at temperature 0.3 from a tiny model
that rarely ends a completion early) is announced on gossip; a peer that claims to hold it serves other
bytes of the same length and is caught (charged BAD_DATA, never asked again); the validator fetches the
real bytes from the worker, checks them against the id, judges and accepts the batch; the trainer's
admission fetches it only once accepted, and the real ``TrainerService`` admits it and takes a GRPO
step on it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from crypto.digests import blake3
from crypto.keys import WalletKey
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.roles.inferer_service import InfererService
from prime_node.roles.trainer_service import TrainerOptions, TrainerService
from prime_node.testing.adversary import build_scenario
from prime_node.verification.batch_publish import (
    MAX_GOSSIPED_BATCH,
    ROLLOUTS_TOPIC,
    publish_batch,
    publish_frame,
)
from prime_node.verification.batch_transfer import BatchTransfer
from prime_node.verification.validator import CheckPolicy
from protocol.codec import encode
from protocol.scoring import ScoringConfig
from tests.one_policy import OnePolicy
from tests.p2p.helpers import wait_until
from tests.verification.network_helpers import fresh, judged, make_scenario, policy_dir, start_swarm

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")
GROUPS, GROUP_SIZE, MAX_TOKENS = 512, 8, 400


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _big_frame(scenario: object) -> bytes:
    """The scheduled batch sealed by the worker: 4,096 samples, ~10 MiB. Dated when it is sealed, after
    the generation: that alone took over 5 minutes on a loaded 2-core machine, and a frame dated before
    it was refused as older than the envelope's freshness window (5 minutes), ``expired``."""
    batch = scenario.batch(0)  # type: ignore[attr-defined]
    scenario.now_ms = time.time_ns() // 1_000_000  # type: ignore[attr-defined]
    return scenario.seal(batch)  # type: ignore[attr-defined, no-any-return]


@pytest.mark.slow
@pytest.mark.timeout(900)  # hang guard: ~10 × a quiet run
async def test_a_large_batch_is_announced_fetched_verified_accepted_and_trained_on(tmp_path: Path) -> None:
    validator_key, trainer_key = WalletKey.generate(), WalletKey.generate()
    scenario = build_scenario(
        model_seed=2,  # of the seeds tried, the one whose completions run longest before EOS
        temperature=0.3,
        group_size=GROUP_SIZE,
        groups=GROUPS,
        max_new_tokens=MAX_TOKENS,
        trusted_validators=(str(validator_key.address),),
        length_reward={"coef": 1.0, "target_tokens": MAX_TOKENS // 2},  # informative groups
        output_dir=str(tmp_path / "out"),
    )
    scenario.current_step = 0  # the trainer starts at step 0 and admits no batch from its future
    frame = await trio.to_thread.run_sync(_big_frame, scenario)
    batch_id = blake3(frame)
    assert 8 << 20 <= len(frame) <= scenario.config.max_rollout_batch_bytes, len(frame)

    trainer = TrainerService(
        key=trainer_key,
        run_config=scenario.config,
        swarm=None,  # type: ignore[arg-type]  # the intake and one step run here: nothing is shared
        admission=None,  # type: ignore[arg-type]  # set below, once the network is up
        options=TrainerOptions(model_dir=policy_dir(scenario, tmp_path), evaluate=False),
    )
    trainer.session = await trio.to_thread.run_sync(trainer._open)
    lenient = ScoringConfig(ban_threshold=-1e12)  # see the offence in the score, keep the liar connected
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(
            nursery,
            OPEN,
            tmp_path,
            scenario,
            [validator_key],
            scoring=lenient,
            observers=1,
            validator_kwargs={0: {"check_policy": CheckPolicy(recompute_groups=4)}},
        )
        assert swarm.admission is not None
        trainer.admission = swarm.admission
        nursery.start_soon(trainer._intake)
        validator_node, service = swarm.validators[0]
        liar = swarm.others[0]
        worker_transfer = BatchTransfer(scenario.key, host_of=lambda _: None)
        liar_transfer = BatchTransfer(liar.key, host_of=lambda _: None)
        await nursery.start(worker_transfer.run)
        await nursery.start(liar_transfer.run)
        await trio.sleep(2)  # let the gossipsub mesh settle after the connections

        # The liar announces the batch first, with bytes of the right length that are not the batch.
        liar_transfer.store[batch_id] = bytes(len(frame))
        liar_claim = _announcement(frame, scenario, port=liar_transfer.port)
        await liar.gossip.publish(ROLLOUTS_TOPIC, encode(liar_claim))
        assert service.transfer is not None and swarm.admission.transfer is not None
        validator_book, trainer_book = service.transfer.book, swarm.admission.transfer.book
        await wait_until(
            lambda: bool(validator_book.holders(batch_id)) and bool(trainer_book.holders(batch_id)), 30
        )

        published = await publish_frame(
            swarm.inferer, frame, transfer=worker_transfer, max_size=scenario.config.max_rollout_batch_bytes
        )
        assert published == batch_id
        assert await judged(service, batch_id, timeout=240) == ()
        validator_stats = service.transfer.status()
        assert validator_stats["bad_bytes"] == 1 and validator_stats["fetched"] == 1
        assert validator_node.policy.score(liar.record().peer_id) < 0  # charged BAD_DATA
        assert worker_transfer.counts["served"] >= 1

        await wait_until(lambda: trainer.batches_accepted + sum(trainer.rejected.values()) >= 1, 240)
        assert trainer.batches_accepted == 1, trainer.rejected
        admission_stats = swarm.admission.transfer.status()
        assert admission_stats["fetched"] == 1 and admission_stats["fetched_bytes"] == len(frame)
        gathered = trainer.gatherer.take(trainer.step)
        assert gathered is not None and gathered.batches
        metrics = await trio.to_thread.run_sync(trainer._train, [c.item for c in gathered.batches])
        assert metrics.step == 1 and metrics.groups_kept >= 1
        nursery.cancel_scope.cancel()


async def test_small_batches_take_the_same_path_and_oversize_offers_are_refused_unfetched(
    tmp_path: Path,
) -> None:
    validator = WalletKey.generate()
    scenario = make_scenario([validator])
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, OPEN, tmp_path, scenario, [validator])
        assert swarm.admission is not None
        service = swarm.validators[0][1]
        worker_transfer = BatchTransfer(scenario.key, host_of=lambda _: None)
        await nursery.start(worker_transfer.run)
        await trio.sleep(2)  # let the gossipsub mesh settle after the connections

        cap = scenario.config.max_rollout_batch_bytes
        oversize = dataclasses.replace(
            _announcement(
                b"x", scenario, port=worker_transfer.port, header_of=fresh(scenario).honest_frames(3)[0]
            ),
            size=cap + 1,
        )
        await swarm.inferer.gossip.publish(ROLLOUTS_TOPIC, encode(oversize))
        await wait_until(lambda: service.rejected["batch_too_large"] == 1, 30)

        batch = fresh(scenario).batch(8)  # a few KiB: it would fit gossip, and is announced all the same
        batch_id = await publish_batch(
            swarm.inferer, scenario.key, batch, transfer=worker_transfer, inline_limit=0
        )
        assert await judged(service, batch_id) == ()
        with trio.fail_after(60):
            got = await swarm.admission.next_accepted()
        assert (got.batch_id, got.batch) == (batch_id, batch)
        assert service.transfer is not None and swarm.admission.transfer is not None
        assert service.transfer.counts["fetched"] == 1 and swarm.admission.transfer.counts["fetched"] == 1
        assert not service.transfer.counts["attempt_failed"] and not service.transfer.counts["bad_bytes"]
        assert worker_transfer.counts["served"] <= 2  # the trainer may have fetched from the validator
        nursery.cancel_scope.cancel()


async def test_fetches_are_bounded_by_bytes_held_and_by_what_the_trainer_has_taken(tmp_path: Path) -> None:
    keys = [WalletKey.generate(), WalletKey.generate()]
    scenario = make_scenario(keys)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(
            nursery, OPEN, tmp_path, scenario, keys, validator_kwargs={1: {"max_held_bytes": 100}}
        )
        assert swarm.admission is not None
        swarm.admission.fetch_ahead = 1
        judge, full = swarm.validators[0][1], swarm.validators[1][1]
        worker_transfer = BatchTransfer(scenario.key, host_of=lambda _: None)
        await nursery.start(worker_transfer.run)
        await trio.sleep(2)  # let the gossipsub mesh settle after the connections

        ids = []
        for counter in (11, 12, 13):
            batch = fresh(scenario).batch(counter)
            ids.append(
                await publish_batch(
                    swarm.inferer, scenario.key, batch, transfer=worker_transfer, inline_limit=0
                )
            )
        for batch_id in ids:
            assert await judged(judge, batch_id) == ()
        # The validator that may hold only 100 bytes fetched nothing and says so.
        await wait_until(lambda: full.counts["dropped_backlog"] == 3, 30)
        assert full.transfer is not None and not full.transfer.counts["fetched"]
        # All three are accepted, but the trainer's admission fetches one ahead of what it has handed out.
        admission = swarm.admission

        def held_back() -> tuple[int, int, int]:
            stats = admission.stats()
            return stats["ready"], stats["fetching"], stats["waiting_to_fetch"]

        await wait_until(lambda: held_back() == (1, 0, 2), 30)
        got = []
        with trio.fail_after(60):
            for _ in ids:
                got.append((await swarm.admission.next_accepted()).batch_id)
                assert swarm.admission.stats()["fetching"] + swarm.admission.stats()["ready"] <= 1
        assert sorted(got) == sorted(ids)
        nursery.cancel_scope.cancel()


async def test_the_inferer_service_announces_a_batch_over_the_gossip_cap(tmp_path: Path) -> None:
    validator = WalletKey.generate()
    scenario = fresh(
        build_scenario(
            group_size=8, groups=64, max_new_tokens=96, trusted_validators=(str(validator.address),)
        )
    )
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, OPEN, tmp_path, scenario, [validator])
        assert swarm.admission is not None
        service = swarm.validators[0][1]
        await trio.sleep(2)  # let the gossipsub mesh settle after the connections
        inferer = InfererService(
            key=scenario.key,
            run_config=scenario.config,
            swarm=OnePolicy(scenario.current_step, policy_dir(scenario, tmp_path)),
        )
        await nursery.start(inferer.run, swarm.inferer.context)
        with trio.fail_after(120):
            got = await swarm.admission.next_accepted()
        assert got.batch.worker == scenario.key.address and inferer.published >= 1
        assert inferer.transfer is not None and inferer.transfer.counts["served"] >= 1
        frame = inferer.transfer.store[got.batch_id]
        assert len(frame) > MAX_GOSSIPED_BATCH  # too big for gossip: it was announced and fetched
        assert await judged(service, got.batch_id) == ()
        await wait_until(lambda: inferer.accepted >= 1, 60)  # the verdict reached the inferer too
        nursery.cancel_scope.cancel()


def _announcement(frame: bytes, scenario: object, *, port: int, header_of: bytes | None = None) -> Any:
    from protocol.codec import decode
    from protocol.envelope import Envelope
    from protocol.rollout_transfer import announcement_for
    from protocol.rollouts import peek_header

    header = peek_header(decode(header_of or frame, Envelope).payload)
    return announcement_for(
        frame,
        run_id=header.run_id,
        worker=header.worker,
        policy_step=header.policy_step,
        batch_counter=header.batch_counter,
        port=port,
    )
