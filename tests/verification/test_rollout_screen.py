"""The pure pieces of the validator's intake: screening a rollout frame on arrival, the round-robin queue
and the waiting room for frames whose checkpoint has not arrived."""

from __future__ import annotations

from dataclasses import replace

import pytest

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.verification.proving import rollout_domain, seal_batch
from prime_node.verification.reasons import Reason
from protocol.codec import encode
from protocol.envelope import Domain, FreshnessWindow, seal
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.fair_queue import FairQueue
from protocol.rollout_screen import offence_for, screen_rollout
from protocol.rollouts import RolloutBatch
from protocol.scoring import Offence
from protocol.waiting_room import WaitingRoom
from tests.verification.policy_flood import future_batch

NOW_MS = 1_700_000_000_000
CONFIG = RunConfig.model_validate({"run_id": "screen", "group_size": 2, "prompts_per_step": 2})
KEY = WalletKey.generate()


def _screen(frame: bytes, *, sender: WalletKey = KEY, newest: int = 5, now_ms: int = NOW_MS) -> int:
    screened = screen_rollout(
        frame,
        domain=rollout_domain(CONFIG.run_id),
        window=FreshnessWindow(),
        sender=sender.address,
        run_id=CONFIG.run_id,
        newest_step=newest,
        future_steps=1,
        now_ms=now_ms,
    )
    return screened.header.policy_step


def _frame(step: int = 5, *, key: WalletKey = KEY, worker: WalletKey = KEY, **batch: object) -> bytes:
    made = replace(future_batch(CONFIG, worker, step, 0), **batch)  # type: ignore[arg-type]
    return encode(seal_batch(key, made, now_ms=NOW_MS))


def _sealed(batch: RolloutBatch) -> bytes:
    """Sealed for this run's rollout domain whatever run the batch names."""
    return encode(seal(KEY, rollout_domain(CONFIG.run_id), encode(batch), now_ms=NOW_MS))


def _reason(frame: bytes, **kwargs: object) -> str:
    with pytest.raises(RemoteProtocolError) as caught:
        _screen(frame, **kwargs)  # type: ignore[arg-type]
    return caught.value.reason


def test_a_plausible_frame_passes_with_its_claimed_step() -> None:
    assert _screen(_frame(6)) == 6  # one past the newest published step: a manifest not heard yet
    assert _screen(_frame(0)) == 0  # stale frames pass: the pipeline answers them with a verdict


def test_each_early_refusal_has_its_reason_and_every_reason_is_a_validator_reason() -> None:
    other = WalletKey.generate()
    tampered = bytearray(_frame())
    tampered[-3] ^= 0x01  # inside the signature
    cases = {
        "malformed_envelope": _reason(b"\x93junk"),
        "signer_mismatch": _reason(_frame(), sender=other),  # relayed: signed by another than its sender
        "bad_signature": _reason(bytes(tampered)),
        "expired": _reason(_frame(), now_ms=NOW_MS + 10 * 60_000),
        "from_the_future": _reason(_frame(), now_ms=NOW_MS - 10 * 60_000),
        "signer_not_worker": _reason(_frame(worker=other)),
        "wrong_run": _reason(_sealed(replace(future_batch(CONFIG, KEY, 5, 0), run_id="another"))),
        "future_policy": _reason(_frame(7)),
        "malformed_batch": _reason(encode(seal(KEY, rollout_domain(CONFIG.run_id), b"\x01", now_ms=NOW_MS))),
        "wrong_domain": _reason(encode(seal(KEY, Domain("heartbeat", CONFIG.run_id), b"", now_ms=NOW_MS))),
    }
    assert cases["bad_signature"] in {"bad_signature", "signer_mismatch"}
    cases.pop("bad_signature")
    assert cases == {reason: reason for reason in cases}
    assert all(reason in Reason._value2member_map_ for reason in cases)


def test_what_a_refusal_costs_its_sender() -> None:
    assert offence_for("bad_signature", certain=False) is Offence.INVALID_SIGNATURE
    assert offence_for("signer_not_worker", certain=False) is Offence.SIGNER_MISMATCH
    assert offence_for("malformed_batch", certain=False) is Offence.MALFORMED
    assert offence_for("replay", certain=False) is Offence.STALE
    assert offence_for("behind_replay_window", certain=False) is None  # an overloaded cache, not the sender
    # A step nobody published: certain only when the trainer's announcements are heard.
    assert offence_for("future_policy", certain=True) is Offence.BAD_DATA
    assert offence_for("future_policy", certain=False) is Offence.STALE


def test_the_fair_queue_serves_keys_in_turn_and_bounds_each_key() -> None:
    queue: FairQueue[str, int] = FairQueue(capacity=6, per_key=3)
    dropped = [d for n in range(5) for d in queue.push("flood", n)]
    assert dropped == [0, 1]  # the flooder's own oldest go
    assert queue.push("honest", 100) == []
    assert [queue.pop() for _ in range(2)] == [("flood", 2), ("honest", 100)]
    assert len(queue) == 2
    for key, item in (("a", 1), ("b", 2), ("a", 3), ("a", 4)):
        assert queue.push(key, item) == []
    assert queue.push("c", 5) == [1]  # over capacity: the longest queue ("a") loses its oldest
    assert queue.lengths() == {"flood": 2, "a": 2, "b": 1, "c": 1}
    popped = [queue.pop() for _ in range(len(queue))]
    assert popped == [("flood", 3), ("a", 3), ("b", 2), ("c", 5), ("flood", 4), ("a", 4)]
    with pytest.raises(LocalProtocolError):
        queue.pop()


def test_the_waiting_room_refuses_a_keys_newest_and_hands_back_ready_and_expired_items() -> None:
    room: WaitingRoom[str, str] = WaitingRoom(capacity=4, per_key=2)
    assert room.park("flood", 9, "f0", now=0, deadline=30) == []
    assert room.park("flood", 9, "f1", now=1, deadline=31) == []
    assert [w.item for w in room.park("flood", 9, "f2", now=2, deadline=32)] == ["f2"]
    room.park("honest", 6, "h0", now=3, deadline=33)
    assert room.next_deadline() == 30
    released, expired = room.sweep(10, lambda step: step == 6)
    assert ([w.item for w in released], expired) == (["h0"], [])
    released, expired = room.sweep(30.5, lambda step: False)
    assert (released, [w.item for w in expired]) == ([], ["f0"])
    assert len(room) == 1 and room.next_deadline() == 31
    with pytest.raises(LocalProtocolError):
        WaitingRoom[str, str](capacity=0, per_key=1)
