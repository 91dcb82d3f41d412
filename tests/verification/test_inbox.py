"""The one rollout inbox (prime_node/verification/inbox/) as the validator and the trainer's admission use
it: the same screening, fetch bounds, charging rule and hooks on both roles; the newest-first order of
fetch slots and of the judge queue. Real services, real signatures and real data-plane channels over the
in-memory stream network, in virtual time; the node context is a small stand-in with real peer scores."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from crypto.digests import blake3
from crypto.keys import Address, WalletKey
from prime_node.config import RunConfig
from prime_node.node.context import NodeContext
from prime_node.node.gossip import Delivered
from prime_node.testing.memory_streams import MemoryStreamNetwork
from prime_node.verification.admission_service import AdmissionService
from prime_node.verification.batch_transfer import BatchTransfer
from prime_node.verification.fair_slots import FairSlots, NewestFirstQueue
from prime_node.verification.inbox import IntakeHooks, RolloutInbox, new_batch_id
from prime_node.verification.proving import seal_batch
from prime_node.verification.service import ValidatorService, ValidatorSettings
from prime_node.verification.transfer_settings import TransferSettings
from protocol.codec import encode
from protocol.fair_queue import FairQueue
from protocol.rollout_transfer import announcement_for
from protocol.scoring import PeerScores
from tests.verification.policy_flood import future_batch
from tests.verification.test_announcement_attacks import HOST, _Hostile, _start

NOW_MS = 1_700_000_000_000
STEP = 5
TRUSTED = WalletKey.generate()
CONFIG = RunConfig.model_validate(
    {
        "run_id": "inbox",
        "group_size": 2,
        "prompts_per_step": 2,
        "max_rollout_batch_bytes": 64 << 20,
        "trusted_validators": [str(TRUSTED.address)],
    }
)


class _Policy:
    """The node's peer policy as the inbox uses it, over real ``PeerScores``."""

    def __init__(self) -> None:
        self.scores = PeerScores()
        self.charged: list[tuple[str, str]] = []

    def offence(self, peer_id: str, offence: Any, reason: str) -> None:
        self.charged.append((peer_id, offence.value))
        self.scores.offence(peer_id, offence, trio.current_time())

    def is_banned(self, peer_id: str) -> bool:
        return self.scores.is_banned(peer_id, trio.current_time())


class _Gossip:
    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def subscribe(self, name: str, handler: object) -> str:
        return name

    async def publish(self, topic: str, payload: bytes) -> None:
        self.published.append((topic, payload))


def _context(key: WalletKey) -> NodeContext:
    clock = SimpleNamespace(wall_ms=lambda: NOW_MS, now=trio.current_time)
    membership = SimpleNamespace(members=lambda: [])
    fake = SimpleNamespace(policy=_Policy(), gossip=_Gossip(), clock=clock, key=key, membership=membership)
    return cast(NodeContext, fake)


def _validator(transfer: BatchTransfer | None = None, **settings: Any) -> ValidatorService:
    hooks = settings.pop("hooks", None)
    held = settings.pop("held", None)  # where every step's checkpoint is (None: no step's)
    return ValidatorService(
        key=WalletKey.generate(),
        run_config=CONFIG,
        locate=lambda _: held,
        current_step=lambda: STEP,
        settings=ValidatorSettings(**settings),
        transfer=transfer,
        hooks=hooks,
    )


def _admission(transfer: BatchTransfer | None = None, **kwargs: Any) -> AdmissionService:
    return AdmissionService(run_config=CONFIG, transfer=transfer, **kwargs)


def _inbox(service: ValidatorService | AdmissionService) -> RolloutInbox:
    return service.inbox


async def _run_inbox(nursery: trio.Nursery, service: ValidatorService | AdmissionService) -> NodeContext:
    """Run only the service's inbox (no judge, no verdict topic) on a stand-in context."""
    context = _context(WalletKey.generate())
    service._context = context  # the admission reads verdicts through it; the validator judges with it
    if isinstance(service, AdmissionService):
        service.reputation.attach(context)
    await nursery.start(_inbox(service).run, context)
    return context


def _frame(key: WalletKey, step: int = STEP, counter: int = 0) -> bytes:
    return encode(seal_batch(key, future_batch(CONFIG, key, step, counter), now_ms=NOW_MS))


def _gossiped(payload: bytes, sender: WalletKey, *, peer: str | None = None) -> Delivered:
    return Delivered("rollouts", peer or f"peer-{sender.address}", sender.address, payload, NOW_MS, False)


def _policy(context: NodeContext) -> _Policy:
    return cast(_Policy, context.policy)


ROLES = ["validator", "admission"]


def _service(role: str, transfer: BatchTransfer | None = None, **kwargs: Any) -> Any:
    return _validator(transfer, **kwargs) if role == "validator" else _admission(transfer, **kwargs)


# -- the order: newest policy step first, round-robin across workers within a step ----------------------


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 3), st.booleans()), max_size=60))
def test_the_newest_first_queue_on_one_step_is_the_fair_queue(ops: list[tuple[str, int, bool]]) -> None:
    """With every item on one step it drops and serves exactly as protocol/fair_queue.py did."""
    old: FairQueue[str, int] = FairQueue(capacity=6, per_key=3)
    new: NewestFirstQueue[str, int] = NewestFirstQueue(capacity=6, per_key=3)
    for n, (key, _, pop) in enumerate(ops):
        if pop and len(old):
            assert new.pop() == old.pop()
        else:
            assert new.push(key, 7, n) == old.push(key, n)
        assert new.lengths() == old.lengths() and len(new) == len(old)


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 3)), min_size=1, max_size=40))
def test_the_newest_first_queue_serves_the_newest_step_first_and_keys_in_turn(
    pushes: list[tuple[str, int]],
) -> None:
    queue: NewestFirstQueue[str, tuple[str, int, int]] = NewestFirstQueue(capacity=100, per_key=100)
    for n, (key, step) in enumerate(pushes):
        queue.push(key, step, (key, step, n))
    served = [queue.pop()[1] for _ in range(len(pushes))]
    assert [s for _, s, _ in served] == sorted((s for _, s in pushes), reverse=True)
    for step in {s for _, s in pushes}:
        keys = [k for k, s, _ in served if s == step]
        # Within a step no key is served twice while another key of that step still waits.
        for i in range(len(keys) - 1):
            if keys[i] == keys[i + 1]:
                assert set(keys[i:]) == {keys[i]}
        mine = [n for k, s, n in served if s == step and k == keys[0]]
        assert mine == sorted(mine)  # and each key's batches of a step in arrival order


async def test_fetch_slots_go_to_the_newest_step_first_then_round_robin(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slots: FairSlots[str] = FairSlots(1)
    order: list[tuple[str, int]] = []

    async def take(key: str, step: int) -> None:
        async with slots.hold(key, priority=step):
            order.append((key, step))
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for key, step in (("a", 1), ("a", 1), ("a", 2), ("b", 1), ("b", 2), ("c", 2)):
            nursery.start_soon(take, key, step)
            await trio.sleep(0.01)  # queue in this order
    # ("a", 1) took the free slot; then step 2 (a, b, c in turn), then step 1 in turn.
    assert order == [("a", 1), ("a", 2), ("b", 2), ("c", 2), ("a", 1), ("b", 1)]
    assert slots.used == 0 and slots.waiting() == 0


# Moved from test_announcement_attacks.py (same names, same assertions): the round-robin of fetch slots.
async def test_slots_are_granted_round_robin_across_keys(autojump_clock: trio.testing.MockClock) -> None:
    slots: FairSlots[str] = FairSlots(1)
    order: list[str] = []

    async def take(key: str) -> None:
        async with slots.hold(key):
            order.append(key)
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for key in ("flood", "flood", "flood", "flood", "honest"):
            nursery.start_soon(take, key)
            await trio.sleep(0.01)  # queue in this order
    # First come first served would give "honest" the slot last; round-robin gives it the second.
    assert order == ["flood", "flood", "honest", "flood", "flood"]
    assert slots.used == 0 and slots.waiting() == 0


async def test_a_cancelled_waiter_gives_up_its_place_and_a_granted_one_its_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slots: FairSlots[Address | str] = FairSlots(1)
    async with trio.open_nursery() as nursery:

        async def hold_for(seconds: float) -> None:
            async with slots.hold("a"):
                await trio.sleep(seconds)

        nursery.start_soon(hold_for, 5)
        await trio.sleep(0.01)
        with trio.move_on_after(1):
            async with slots.hold("b"):
                raise AssertionError("the slot is taken")
        assert slots.waiting() == 0
    assert slots.used == 0


async def test_the_validator_judges_the_newest_step_first(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    service = ValidatorService(
        key=WalletKey.generate(),
        run_config=CONFIG,
        locate=lambda _: tmp_path,  # every step's checkpoint is held: all go to the judge queue
        current_step=lambda: STEP,
        transfer=BatchTransfer(WalletKey.generate(), host_of=lambda _: None),
    )
    old, new = WalletKey.generate(), WalletKey.generate()
    async with trio.open_nursery() as nursery:
        await _run_inbox(nursery, service)
        for n in range(3):
            await service.inbox.on_rollout(_gossiped(_frame(old, STEP - 1, n), old))
        await service.inbox.on_rollout(_gossiped(_frame(new, STEP, 0), new))
        served = [service._queue.pop()[1] for _ in range(4)]
        assert [item.step for item in served] == [STEP, STEP - 1, STEP - 1, STEP - 1]
        nursery.cancel_scope.cancel()


# -- the fetch bounds, on both roles ---------------------------------------------------------------------


def _offer(peer: _Hostile, counter: int, size: int = 1 << 20, step: int = STEP) -> Any:
    offer = announcement_for(
        peer.key.address.raw + counter.to_bytes(8, "big"),  # a batch id of its own per worker and counter
        run_id=CONFIG.run_id,
        worker=peer.key.address,
        policy_step=step,
        batch_counter=counter,
        port=peer.port,
    )
    return dataclasses.replace(offer, size=size)


def _announce(inbox: RolloutInbox, peer: _Hostile, counter: int, **kwargs: Any) -> bytes:
    offer = _offer(peer, counter, **kwargs)
    message = Delivered(
        "rollouts", f"peer-{peer.key.address}", peer.key.address, encode(offer), NOW_MS, False
    )
    inbox._on_announcement(message, offer)
    return offer.batch_id


def _transfer(network: MemoryStreamNetwork) -> BatchTransfer:
    return BatchTransfer(
        WalletKey.generate(),
        host_of=lambda _: HOST,
        host=HOST,
        transport=network,
        settings=TransferSettings(),
    )


# Moved from test_announcement_attacks.py, against the inbox's bounds now (same scenario and numbers).
async def test_past_all_workers_bounds_a_worker_with_fewer_pending_fetches_evicts_the_busiest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryStreamNetwork()
    sybil, second, third = (_Hostile(network, "silent") for _ in range(3))
    transfer = _transfer(network)
    service = _validator(transfer, queue_size=4, per_worker_fetches=4)
    bounds = service.inbox.bounds
    async with trio.open_nursery() as nursery:
        await _start(nursery, sybil, second, third, transfer)
        await _run_inbox(nursery, service)
        for counter in range(4):
            _announce(service.inbox, sybil, counter)  # fills every pending fetch of all workers together
        await trio.sleep(0.1)
        _announce(service.inbox, second, 1)
        _announce(service.inbox, third, 1)
        pending = {w: len(p) for w, p in bounds.pending.items()}
        assert pending == {sybil.key.address: 2, second.key.address: 1, third.key.address: 1}
        assert service.counts["evicted_fetches"] == 2 and bounds.fetches_pending == 4
        _announce(service.inbox, second, 2)  # would make 2: no one has more than that to give up
        assert service.counts["dropped_backlog"] == 1
        assert bounds.held_bytes == 4 << 20
        await trio.sleep(60)  # every fetch ends (undelivered), and every reservation is released
        assert bounds.fetches_pending == 0 and bounds.held_bytes == 0 and not bounds.pending
        nursery.cancel_scope.cancel()


async def test_the_trainer_fetches_at_most_its_share_per_worker_and_the_rest_waits(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, admission fetched every accepted offer of one worker at once (only ``fetch_ahead`` bounded
    it); now each worker has the validator's 4 pending fetches, and the rest wait, newest step first."""
    network = MemoryStreamNetwork()
    silent = _Hostile(network, "silent")
    transfer = _transfer(network)
    service = _admission(transfer, fetch_ahead=16)
    started: list[bytes] = []
    start = service.inbox._start_fetch

    def recorded(offer: Any, *, count: bool) -> bool:
        began = start(offer, count=count)
        if began:
            started.append(offer.announcement.batch_id)
        return began

    monkeypatch.setattr(service.inbox, "_start_fetch", recorded)
    async with trio.open_nursery() as nursery:
        await _start(nursery, silent, transfer)
        await _run_inbox(nursery, service)
        steps = [STEP - 1] * 5 + [STEP]
        ids = [_announce(service.inbox, silent, n, step=step) for n, step in enumerate(steps)]
        for batch_id in ids:
            service.inbox.want(batch_id)  # as an accepting quorum makes it worth fetching
        assert service.inbox.bounds.fetches_pending == 4
        assert service.stats()["waiting_to_fetch"] == 2 and service.counts["fetch_deferred"] >= 2
        await trio.sleep(120)  # the silent holder times out, is backed off: every fetch ends
        assert service.inbox.bounds.fetches_pending == 0 and service.stats()["waiting_to_fetch"] == 0
        assert started[:4] == ids[:4] and started[4:] == [ids[5], ids[4]]  # the newest step first
        assert transfer.counts["fetch_failed"] == 6
        nursery.cancel_scope.cancel()


async def test_the_trainer_charges_a_worker_that_does_not_deliver_its_own_offer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryStreamNetwork()
    silent = _Hostile(network, "silent")
    service = _admission()
    async with trio.open_nursery() as nursery:
        await _start(nursery, silent)
        context = await _run_inbox_with_network(nursery, service, network)
        batch_id = _announce(service.inbox, silent, 1)
        service.inbox.want(batch_id)
        await trio.sleep(60)
        assert service.counts["undelivered"] == 1 and service.counts["charged"] == 1
        assert _policy(context).charged == [(f"peer-{silent.key.address}", "unsolicited")]
        nursery.cancel_scope.cancel()


async def _run_inbox_with_network(
    nursery: trio.Nursery, service: ValidatorService | AdmissionService, network: MemoryStreamNetwork
) -> NodeContext:
    """As ``_run_inbox``, with a transfer wired to the inbox's own charging callbacks."""
    inbox = _inbox(service)
    inbox.transfer = BatchTransfer(
        WalletKey.generate(),
        host_of=lambda _: HOST,
        host=HOST,
        transport=network,
        on_bad_bytes=inbox.on_bad_bytes,
        on_undelivered=inbox.on_undelivered,
    )
    await nursery.start(inbox.transfer.run)
    return await _run_inbox(nursery, service)


# -- screening and the one charging rule, on both roles --------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
async def test_a_frame_relayed_by_another_key_is_refused_and_its_sender_charged_on_both_roles(
    role: str, autojump_clock: trio.testing.MockClock
) -> None:
    """Before, the trainer's admission counted such a frame and charged no one."""
    worker, relayer = WalletKey.generate(), WalletKey.generate()
    service = _service(role, BatchTransfer(WalletKey.generate(), host_of=lambda _: None))
    async with trio.open_nursery() as nursery:
        context = await _run_inbox(nursery, service)
        await service.inbox.on_rollout(_gossiped(_frame(worker), relayer))
        assert service.inbox.refused == Counter({"signer_mismatch": 1})
        assert _policy(context).charged == [(f"peer-{relayer.address}", "signer_mismatch")]
        honest = _frame(worker, counter=1)
        await service.inbox.on_rollout(_gossiped(honest, worker))
        assert service.inbox.refused == Counter({"signer_mismatch": 1})  # the honest one passed
        nursery.cancel_scope.cancel()


async def test_the_trainer_refuses_an_offer_past_its_own_step_when_it_knows_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryStreamNetwork()
    ahead = _Hostile(network, "silent")
    service = _admission(_transfer(network), newest_step=lambda: STEP)
    async with trio.open_nursery() as nursery:
        await _start(nursery, ahead)
        context = await _run_inbox(nursery, service)
        _announce(service.inbox, ahead, 1, step=STEP + 2)
        assert service.inbox.refused == Counter({"future_policy": 1}) and not service.inbox.offers_kept
        # The trainer's own step is authoritative: a step it never published costs bad_data.
        assert _policy(context).charged == [(f"peer-{ahead.key.address}", "bad_data")]
        nursery.cancel_scope.cancel()


# -- the floor hook --------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
async def test_a_batch_below_the_trainers_floor_is_dropped_uncharged_before_fetch_or_judgement(
    role: str, autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    network = MemoryStreamNetwork()
    holder, worker = _Hostile(network, "silent"), WalletKey.generate()
    floor = [STEP]
    hooks = IntakeHooks(floor=lambda: floor[0])
    held = {"held": tmp_path} if role == "validator" else {}
    service = _service(role, _transfer(network), hooks=hooks, **held)
    async with trio.open_nursery() as nursery:
        await _start(nursery, holder)
        context = await _run_inbox(nursery, service)
        dials = network.dials
        _announce(service.inbox, holder, 1, step=STEP - 1)
        await service.inbox.on_rollout(_gossiped(_frame(worker, STEP - 1), worker))
        await service.inbox.on_rollout(_gossiped(_frame(worker, STEP, 1), worker))  # at the floor: kept
        assert service.counts["below_floor"] == 2 and network.dials == dials  # nothing fetched
        assert _policy(context).charged == []  # late, not dishonest
        assert service.inbox.refused == Counter()  # not a refusal: no charge, no refused_on_arrival
        if isinstance(service, ValidatorService):
            assert service.rejected["below_floor"] == 2 and len(service._queue) == 1
            floor[0] = STEP + 1  # the floor rose while the batch waited: dropped before judgement too
            nursery.start_soon(service._check_loop, context)
            await trio.sleep(1)
            assert service.rejected["below_floor"] == 3 and not len(service._queue)
            assert service.counts["validated"] == 0 and service.inbox.held_bytes == 0
        else:
            assert service.rejected_by_reason["below_floor"] == 2 and service.stats()["pending"] == 1
        nursery.cancel_scope.cancel()


# -- the archive hook ------------------------------------------------------------------------------------


async def _settled(done: Callable[[], bool]) -> None:
    """Wait (real time: the archive runs in a worker thread) until ``done``; a hang guard, no bound."""
    with trio.fail_after(30):
        while not done():
            await trio.sleep(0.01)


class _Archive:
    """A real archive on disk; ``fail`` makes it raise as a full disk would."""

    def __init__(self, root: Path, *, fail: bool = False) -> None:
        self.root = root
        self.fail = fail
        self.kept: list[tuple[str, str, int]] = []

    def keep(self, frame: bytes, *, batch_id: str, worker: str, policy_step: int) -> Path | None:
        if self.fail:
            raise OSError("no space left on device")
        path = self.root / f"{batch_id}.frame"
        path.write_bytes(frame)
        self.kept.append((batch_id, worker, policy_step))
        return path


@pytest.mark.parametrize("role", ROLES)
async def test_every_screened_batch_is_archived_once_and_a_failing_archive_never_stops_intake(
    role: str, tmp_path: Path
) -> None:
    worker, relayer = WalletKey.generate(), WalletKey.generate()
    archive = _Archive(tmp_path)
    service = _service(role, BatchTransfer(WalletKey.generate(), host_of=lambda _: None))
    service.inbox.hooks = IntakeHooks(archive=archive)  # wired after construction, as the node does
    frame = _frame(worker)
    async with trio.open_nursery() as nursery:
        await _run_inbox(nursery, service)
        await service.inbox.on_rollout(_gossiped(frame, worker))
        await service.inbox.on_rollout(_gossiped(frame, worker))  # the same batch again: archived once
        await service.inbox.on_rollout(_gossiped(_frame(worker, counter=1), relayer))  # refused: not kept
        await _settled(lambda: service.counts["archived"] == 1)

        batch_id = blake3(frame).hex()
        assert archive.kept == [(batch_id, str(worker.address), STEP)]
        assert (tmp_path / f"{batch_id}.frame").read_bytes() == frame
        assert (
            service.inbox.archiver is not None and service.inbox.archiver.archived[blake3(frame)] is not None
        )
        archive.fail = True
        await service.inbox.on_rollout(_gossiped(_frame(worker, counter=2), worker))
        await _settled(lambda: service.counts["archive_failed"] == 1)
        assert service.counts["archive_failed"] == 1 and service.counts["archived"] == 1
        if isinstance(service, ValidatorService):  # both reached the judge queue regardless
            assert len(service._waiting) + len(service._queue) >= 2
        else:
            assert service.stats()["pending"] == 2
        nursery.cancel_scope.cancel()


def test_a_demand_view_counts_a_frame_and_a_workers_own_offer_but_not_a_re_servers() -> None:
    """``new_batch_id``: the rule roles/demand_taps's backlog applies to the topic, in the inbox's package."""
    worker, validator = WalletKey.generate(), WalletKey.generate()
    frame = _frame(worker)
    offer = announcement_for(
        frame, run_id=CONFIG.run_id, worker=worker.address, policy_step=STEP, batch_counter=0, port=1
    )
    assert new_batch_id(frame, worker.address) == blake3(frame)
    assert new_batch_id(encode(offer), worker.address) == offer.batch_id
    assert new_batch_id(encode(dataclasses.replace(offer, port=2)), validator.address) is None
