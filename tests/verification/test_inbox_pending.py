"""The batches the trainer heard announced and has not judged (``PendingBatches``, issue 38): counted in
its demand as had, bounded so hostile announcements cannot make it believe it has work it has not."""

from __future__ import annotations

from collections import Counter

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.keys import WalletKey
from prime_node.testing.memory_streams import MemoryStreamNetwork
from prime_node.verification.inbox import IntakeHooks
from prime_node.verification.inbox.pending import PENDING_TIMEOUT_S, PendingBatches
from tests.verification.test_announcement_attacks import _Hostile, _start
from tests.verification.test_inbox import (
    STEP,
    _admission,
    _announce,
    _frame,
    _gossiped,
    _run_inbox,
    _transfer,
)

WORKERS = [WalletKey.generate().address for _ in range(4)]

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("heard"), st.integers(0, 3), st.integers(0, 30), st.integers(0, 5)),
        st.tuples(st.just("settled"), st.integers(0, 30), st.just(0), st.just(0)),
        st.tuples(st.just("wait"), st.integers(0, 30), st.just(0), st.just(0)),
        st.tuples(st.just("vouch"), st.integers(0, 3), st.integers(-1, 30), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(1, 4), st.integers(1, 12), st.integers(1, 3))
def test_counted_batches_stay_within_every_bound_and_match_a_model(
    ops: list[tuple[str, int, int, int]], per_worker: int, max_batches: int, max_workers: int
) -> None:
    pending = PendingBatches(
        per_worker=per_worker, timeout_s=10.0, max_batches=max_batches, max_workers=max_workers
    )
    now = 0.0
    newest: dict[int, int] = {}
    for op, a, b, c in ops:
        if op == "heard":
            worker, batch = WORKERS[a], f"{a}:{b}".encode()
            vouched = pending.is_vouched(worker)
            counted = pending.heard(batch, worker, policy_step=c, counter=b, now=now)
            assert vouched or not counted  # an unvouched worker's batch never counts
            if vouched:
                newest[a] = max(newest.get(a, -1), b)
        elif op == "vouch":  # by its accepted batch ``b`` (-1: no counter given)
            pending.vouched(WORKERS[a], None if b < 0 else b)
            if b >= 0:
                newest[a] = max(newest.get(a, -1), b)
        elif op == "settled":
            for w in range(4):
                pending.settled(f"{w}:{a}".encode())
        else:
            now += a
        counts = pending.by_policy(now)
        assert sum(counts.values()) == len(pending) <= max_batches
        per = Counter(p.worker for p in pending._pending.values())
        assert all(n <= per_worker for n in per.values())
        assert all(now - p.heard_at <= 10.0 for p in pending._pending.values())
        marks = dict(pending.marks(16))
        assert len(marks) <= max_workers
        # never above what was heard (an inferer never thinks the trainer counts what it has not heard);
        # exact unless the worker was forgotten meanwhile (then it counts more of its own: conservative)
        assert all(marks[WORKERS[w]] <= newest[w] for w in newest if WORKERS[w] in marks)
        if max_workers >= len(WORKERS):
            assert marks == {WORKERS[w]: n for w, n in newest.items()}


def test_a_worker_holds_at_most_its_share_until_settled_or_timed_out() -> None:
    pending = PendingBatches(per_worker=2, timeout_s=20.0)
    hostile, honest = WORKERS[0], WORKERS[1]
    pending.vouched(hostile)  # each had a batch accepted
    pending.vouched(honest)
    for counter in range(10):  # a flood of offers: two count
        pending.heard(bytes([counter]), hostile, policy_step=5, counter=counter, now=0.0)
    assert pending.by_policy(0.0) == {5: 2} and pending.not_counted == 8
    assert pending.heard(b"honest", honest, policy_step=6, counter=1, now=1.0)
    assert pending.by_policy(1.0) == {5: 2, 6: 1}
    assert pending.settled(b"honest") and not pending.settled(b"honest")  # counted once
    assert pending.by_policy(20.5) == {}  # the flood's never judged: forgotten after the timeout
    assert pending.marks(1) == ((honest, 1),) and dict(pending.marks(16))[hostile] == 9


def test_workers_with_no_accepted_batch_count_nothing_however_many_keys() -> None:
    """A fresh key costs nothing: Sybil keys announcing batches they never send would fill the demand
    (4 each) and starve the trainer. Until an accepting quorum vouched for one of a worker's batches, its
    announcements are neither counted nor marked (its inferer counts them itself)."""
    pending = PendingBatches(per_worker=4, max_workers=8)
    sybils = [WalletKey.generate().address for _ in range(50)]
    for number, sybil in enumerate(sybils):
        for counter in range(4):
            assert not pending.heard(f"{number}:{counter}".encode(), sybil, 5, counter, now=0.0)
    assert pending.by_policy(0.0) == {} and pending.marks(16) == () and pending.not_vouched == 200
    honest = WORKERS[0]
    assert not pending.heard(b"first", honest, 5, 0, now=0.0)  # its first batch: not yet vouched
    assert not pending.heard(b"second", honest, 5, 1, now=0.0)
    pending.vouched(honest, 0)  # by its first batch, accepted: the mark covers it (its inferer stops
    assert pending.marks(16) == ((honest, 0),)  # counting it as on its way)
    assert pending.heard(b"third", honest, 5, 2, now=0.0) and pending.marks(16) == ((honest, 2),)
    for sybil in sybils:  # vouching is bounded: the oldest vouched are forgotten first
        pending.vouched(sybil)
    assert not pending.is_vouched(honest) and sum(pending.is_vouched(s) for s in sybils) == 8


async def test_the_trainers_admission_counts_what_it_heard_within_each_workers_share(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The real ``AdmissionService`` over its real inbox: offers and gossiped frames count as soon as
    they pass screening, at most the per-worker fetch share of one worker's; a refused one and one below
    the trainer's floor never count; the demand hears of every change."""
    network = MemoryStreamNetwork()
    flooder = _Hostile(network, "silent")
    worker = WalletKey.generate()
    floor = [STEP - 1]
    service = _admission(
        _transfer(network), hooks=IntakeHooks(floor=lambda: floor[0]), newest_step=lambda: STEP
    )
    changes: list[None] = []
    service.on_change = lambda: changes.append(None)
    async with trio.open_nursery() as nursery:
        await _start(nursery, flooder)
        await _run_inbox(nursery, service)
        _announce(service.inbox, flooder, 100)  # no batch of its accepted yet: not counted
        assert service.pending_by_policy() == {} and service.stats()["heard_not_vouched"] == 1
        service.pending.vouched(flooder.key.address)  # as an accepting quorum's verdict does
        service.pending.vouched(worker.address)
        for counter in range(10):  # ten offers, never delivered: four count
            _announce(service.inbox, flooder, counter)
        assert service.pending_by_policy() == {STEP: 4} and service.stats()["heard_not_counted"] == 6
        await service.inbox.on_rollout(_gossiped(_frame(worker, STEP - 1, 7), worker))
        assert service.pending_by_policy() == {STEP: 4, STEP - 1: 1}
        _announce(service.inbox, flooder, 20, step=STEP - 2)  # below the floor: dropped, never counted
        await service.inbox.on_rollout(_gossiped(_frame(worker, STEP + 5, 8), worker))  # refused on arrival
        assert service.pending_by_policy() == {STEP: 4, STEP - 1: 1}
        # the flooder's unvouched offer (counter 100) was never marked
        assert dict(service.heard_marks(16)) == {worker.address: 7, flooder.key.address: 9}
        assert len(changes) >= 11
        await trio.sleep(PENDING_TIMEOUT_S + 1)  # no verdict came: they stop counting
        assert service.pending_by_policy() == {}
        nursery.cancel_scope.cancel()
