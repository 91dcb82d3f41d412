"""Verification over gossip on the in-memory network (real clock: validation runs in worker threads), with
real tiny-model forward passes and real signatures: inferer → validator → trainer-side admission."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import trio

from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.testing.memory_network import MemoryNetwork
from prime_node.verification.cheating import ATTACKS, EXPECTED_REASONS
from prime_node.verification.service import (
    AdmissionService,
    ValidatorService,
    ValidatorSettings,
    publish_batch,
    publish_frame,
)
from tests.p2p.helpers import wait_until
from tests.verification.network_helpers import (
    LENIENT,
    fresh,
    judged,
    locator,
    make_scenario,
    policy_dir,
    start_swarm,
)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


async def test_an_honest_batch_is_validated_and_reaches_the_trainer(tmp_path: Path) -> None:
    validator = WalletKey.generate()
    scenario = make_scenario([validator])
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, MemoryNetwork().host, tmp_path, scenario, [validator])
        batch = scenario.batch(0)
        batch_id = await publish_batch(swarm.inferer, scenario.key, batch)
        assert swarm.admission is not None
        with trio.fail_after(60):
            got = await swarm.admission.next_accepted()
        assert (got.batch_id, got.worker, got.batch) == (batch_id, scenario.key.address, batch)
        assert len(got.validator_rewards) == len(batch.samples)
        status = swarm.validators[0][0].status_sections["validation"]()
        assert status["validated"] == status["accepted"] == 1 and status["rejected"] == {}
        stats = swarm.admission.stats()
        assert stats["accepted"] == 1
        assert stats["accepted_by_worker"] == {str(scenario.key.address): 1}
        # its first batch was heard before any of its was accepted: not counted in the demand; the
        # accepting verdict vouched for the worker, so its next announcements count, and the demand's
        # mark covers that batch (its inferer stops counting it as on its way: without the mark a lone
        # inferer waited for its verdict timeout, with the trainer idle)
        assert stats["heard_not_vouched"] == 1 and swarm.admission.pending.is_vouched(scenario.key.address)
        assert dict(swarm.admission.heard_marks(16)) == {scenario.key.address: batch.batch_counter}
        nursery.cancel_scope.cancel()


async def test_every_attack_is_rejected_with_its_reason_and_never_admitted(tmp_path: Path) -> None:
    validator = WalletKey.generate()
    scenario = make_scenario([validator])
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(
            nursery, MemoryNetwork().host, tmp_path, scenario, [validator], scoring=LENIENT
        )
        service = swarm.validators[0][1]
        assert swarm.admission is not None
        honest: list[bytes] = []
        for number, attack in enumerate(ATTACKS):
            frames = fresh(scenario).attack_frames(attack, counter=100 + number)
            ids = [await publish_frame(swarm.inferer, frame) for frame in frames]
            if attack == "replayed_batch":  # the first copy is honest work; the second is the replay
                await wait_until(functools.partial(_judged_twice, service, ids[0]), 60)
                first, second = [j for j in service.recent if j.batch_id == ids[0]]
                assert first.accepted and set(second.reasons) & EXPECTED_REASONS[attack]
                honest.append(ids[0])
                continue
            reasons = await judged(service, ids[-1])
            assert set(reasons) & EXPECTED_REASONS[attack], (attack, reasons)
        # A last honest batch: once it is out, everything before it has been decided.
        honest.append(await publish_frame(swarm.inferer, fresh(scenario).honest_frames(999)[0]))
        admitted: list[bytes] = []
        with trio.fail_after(60):
            while len(admitted) < len(honest):
                admitted.append((await swarm.admission.next_accepted()).batch_id)
        assert admitted == honest
        stats = swarm.admission.stats()
        assert stats["accepted"] == 2 and stats["ready"] == 0
        assert sum(stats["rejected"].values()) >= len(ATTACKS) - 2  # envelope-level ones name no worker
        nursery.cancel_scope.cancel()


def _judged_twice(service: ValidatorService, batch_id: bytes) -> bool:
    return sum(j.batch_id == batch_id for j in service.recent) == 2


async def test_verdicts_of_an_untrusted_validator_are_ignored(tmp_path: Path) -> None:
    trusted, rogue = WalletKey.generate(), WalletKey.generate()
    scenario = make_scenario([trusted])
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, MemoryNetwork().host, tmp_path, scenario, [rogue])
        assert swarm.admission is not None
        service = swarm.validators[0][1]
        accepted_id = await publish_batch(swarm.inferer, scenario.key, scenario.batch(0))
        forged = fresh(scenario).attack_frames("forged_proof", counter=1)[0]
        rejected_id = await publish_frame(swarm.inferer, forged)
        assert await judged(service, accepted_id) == ()
        assert await judged(service, rejected_id) != ()
        reputation = swarm.admission.reputation
        await wait_until(lambda: reputation.counts["verdicts_ignored_untrusted_validator"] == 2, 30)
        assert swarm.admission.stats()["accepted"] == 0 and swarm.admission.stats()["ready"] == 0
        worker_peer = swarm.inferer.identity.peer_id
        assert swarm.trainer.policy.score(worker_peer) == 0.0  # the rogue's rejection cost nothing
        nursery.cancel_scope.cancel()


async def test_quorum_two_needs_both_trusted_validators(tmp_path: Path) -> None:
    first, second = WalletKey.generate(), WalletKey.generate()
    scenario = make_scenario([first, second], quorum=2)
    gate = trio.Event()
    directory = policy_dir(scenario, tmp_path)
    late = {"locate": locator(scenario, directory, gate.is_set), "policy_wait_s": 120.0}
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(
            nursery, MemoryNetwork().host, tmp_path, scenario, [first, second], validator_kwargs={1: late}
        )
        assert swarm.admission is not None
        batch_id = await publish_batch(swarm.inferer, scenario.key, scenario.batch(0))
        assert await judged(swarm.validators[0][1], batch_id) == ()
        reputation = swarm.admission.reputation
        await wait_until(lambda: reputation.counts["verdicts_trusted"] == 1, 30)
        assert swarm.admission.stats()["ready"] == 0  # one acceptance of two
        gate.set()  # the second validator's checkpoint arrives
        with trio.fail_after(60):
            got = await swarm.admission.next_accepted()
        assert got.batch_id == batch_id and reputation.counts["verdicts_trusted"] == 2
        nursery.cancel_scope.cancel()


async def test_a_missing_policy_is_awaited_then_rejected_as_unknown(tmp_path: Path) -> None:
    validator = WalletKey.generate()
    scenario = make_scenario([validator])
    never = {"locate": lambda step: None, "policy_wait_s": 1.0}
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(
            nursery, MemoryNetwork().host, tmp_path, scenario, [validator], validator_kwargs={0: never}
        )
        batch_id = await publish_batch(swarm.inferer, scenario.key, scenario.batch(0))
        assert await judged(swarm.validators[0][1], batch_id) == ("unknown_policy",)
        assert swarm.validators[0][1].counts["policy_wait_timeouts"] == 1
        assert swarm.admission is not None
        await wait_until(
            lambda: swarm.admission is not None and swarm.admission.stats()["rejected"] != {}, 30
        )
        assert swarm.admission.stats()["rejected"] == {"unknown_policy": 1}
        nursery.cancel_scope.cancel()


async def test_a_worker_rejected_repeatedly_is_banned_by_peers_that_saw_the_verdicts(tmp_path: Path) -> None:
    validator = WalletKey.generate()
    scenario = make_scenario([validator])
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, MemoryNetwork().host, tmp_path, scenario, [validator], observers=1)
        service = swarm.validators[0][1]
        worker_peer = swarm.inferer.identity.peer_id
        watchers = [swarm.trainer, swarm.validators[0][0], swarm.others[0]]
        for counter in range(3):
            frame = fresh(scenario).attack_frames("forged_proof", counter=counter)[0]
            await judged(service, await publish_frame(swarm.inferer, frame))
            if all(w.policy.is_banned(worker_peer) for w in watchers):
                break
        await wait_until(lambda: all(w.policy.is_banned(worker_peer) for w in watchers), 30)
        assert swarm.others[0].metrics.counters["offence_bad_data"] >= 2
        # Its rollouts no longer reach validation (dropped before it, or not delivered at all).
        validated = service.counts["validated"]
        await publish_batch(swarm.inferer, scenario.key, fresh(scenario).batch(50))
        await trio.sleep(2)
        assert service.counts["validated"] == validated
        assert swarm.admission is not None and swarm.admission.stats()["accepted"] == 0
        nursery.cancel_scope.cancel()


async def test_a_batch_too_big_for_gossip_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    validator = WalletKey.generate()
    scenario = make_scenario([validator])
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, MemoryNetwork().host, tmp_path, scenario, [validator])
        published = swarm.inferer.metrics.counters["gossip_out"]
        with pytest.raises(NodeError, match="gossip cap") as caught:
            await publish_frame(swarm.inferer, b"\x00" * (256 * 1024 + 1))
        assert caught.value.reason == "batch_too_large"
        # Refused before anything reached gossip (the refusal does not yield, so no heartbeat slips in).
        assert swarm.inferer.metrics.counters["gossip_out"] == published
        # The validator is live and in order behind it: the next batch is the first and only one it judges.
        service = swarm.validators[0][1]
        batch_id = await publish_batch(swarm.inferer, scenario.key, scenario.batch(0))
        assert await judged(service, batch_id) == ()
        status = service.status()
        assert status["validated"] == status["accepted"] == 1 and status["rejected"] == {}
        nursery.cancel_scope.cancel()


def test_a_networked_trainer_without_trusted_validators_is_refused() -> None:
    from prime_node.config import RunConfig

    with pytest.raises(NodeError, match="trusted_validators") as caught:
        AdmissionService(run_config=RunConfig.model_validate({}))
    assert caught.value.reason == "no_trusted_validators"
    with pytest.raises(ValueError):
        ValidatorService(
            key=WalletKey.generate(),
            run_config=RunConfig.model_validate({}),
            locate=lambda step: None,
            current_step=lambda: 0,
            settings=ValidatorSettings(queue_size=0),
        )


async def test_a_validators_missing_policy_costs_the_worker_no_reputation(tmp_path: Path) -> None:
    validator = WalletKey.generate()
    scenario = make_scenario([validator])
    never = {"locate": lambda step: None, "policy_wait_s": 0.2}
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(
            nursery, MemoryNetwork().host, tmp_path, scenario, [validator], validator_kwargs={0: never}
        )
        for counter in range(3):
            batch_id = await publish_batch(swarm.inferer, scenario.key, fresh(scenario).batch(counter))
            assert await judged(swarm.validators[0][1], batch_id) == ("unknown_policy",)
        assert swarm.admission is not None
        await wait_until(
            lambda: (
                swarm.admission is not None and swarm.admission.stats()["rejected"] == {"unknown_policy": 3}
            ),
            30,
        )
        assert swarm.trainer.policy.scores.offences(swarm.inferer.identity.peer_id) == {}, (
            swarm.trainer.metrics.counters
        )
        assert swarm.trainer.policy.score(swarm.inferer.identity.peer_id) == 0.0
        nursery.cancel_scope.cancel()
