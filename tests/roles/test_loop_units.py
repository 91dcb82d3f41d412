"""The run announcement (pin, no trust without one, wrong signer, oversize) and step gathering/staleness."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.roles.announcement import announced_config, worker_run_config
from prime_node.roles.gather import STALE_IN_QUEUE, Candidate, StepGatherer
from protocol.codec import decode, encode
from protocol.envelope import Envelope, seal
from protocol.errors import RemoteProtocolError
from protocol.run_announcement import (
    MAX_CONFIG_BYTES,
    RunAnnouncement,
    TrainerTrust,
    announcement_domain,
    canonical_json,
    seal_announcement,
)

NOW = 1_700_000_000_000


def _announce(key: WalletKey, run_id: str = "loop", **fields: object) -> Envelope:
    config = RunConfig(run_id=run_id, group_size=4, prompts_per_step=2, **fields)  # type: ignore[arg-type]
    announcement = RunAnnouncement(run_id, key.address, announced_config(config, key.address), NOW)
    return seal_announcement(key, announcement, now_ms=NOW)


def test_without_a_pin_nobody_is_believed_but_everyone_is_listed() -> None:
    trainer, impostor = WalletKey.generate(), WalletKey.generate()
    trust = TrainerTrust("loop")
    for key in (impostor, trainer, impostor):
        with pytest.raises(RemoteProtocolError) as caught:
            trust.offer(_announce(key), now_ms=NOW)
        assert caught.value.reason == "unpinned_trainer"
    assert trust.current is None and trust.trainer is None
    assert [(s.trainer, s.announcements) for s in trust.sightings.values()] == [
        (trainer.address, 1),
        (impostor.address, 2),
    ]


def test_a_pinned_trainer_ignores_an_earlier_impostor() -> None:
    trainer, impostor = WalletKey.generate(), WalletKey.generate()
    trust = TrainerTrust("loop", pinned=trainer.address)
    with pytest.raises(RemoteProtocolError) as caught:
        trust.offer(_announce(impostor), now_ms=NOW)
    assert caught.value.reason == "untrusted_trainer" and trust.current is None
    assert trust.latest is not None and trust.latest.trainer == impostor.address
    assert trust.offer(_announce(trainer), now_ms=NOW).trainer == trainer.address
    assert set(trust.sightings) == {("loop", trainer.address), ("loop", impostor.address)}


def test_an_announcement_signed_by_another_key_than_it_names_is_refused() -> None:
    trainer, other = WalletKey.generate(), WalletKey.generate()
    config = RunConfig(run_id="loop")
    announcement = RunAnnouncement("loop", trainer.address, announced_config(config, trainer.address), NOW)
    forged = seal(other, announcement_domain("loop"), encode(announcement), now_ms=NOW)
    with pytest.raises(RemoteProtocolError) as caught:
        TrainerTrust("loop").offer(forged, now_ms=NOW)
    assert caught.value.reason == "signer_mismatch"
    tampered = replace(_announce(trainer), payload=encode(replace(announcement, issued_at_ms=NOW + 1)))
    with pytest.raises(RemoteProtocolError) as caught:
        TrainerTrust("loop").offer(tampered, now_ms=NOW)
    assert caught.value.reason in {"signer_mismatch", "bad_signature"}


def test_oversize_and_malformed_configs_are_refused() -> None:
    key = WalletKey.generate()
    fields = msgpack.unpackb(encode(RunAnnouncement("loop", key.address, b"{}", NOW)), raw=False)
    fields[2][2] = b"{" + b" " * MAX_CONFIG_BYTES + b"}"
    oversize = msgpack.packb(fields, use_bin_type=True)
    with pytest.raises(RemoteProtocolError):
        decode(oversize, RunAnnouncement)
    envelope = seal(key, announcement_domain("loop"), oversize, now_ms=NOW)
    with pytest.raises(RemoteProtocolError):
        TrainerTrust("loop").offer(envelope, now_ms=NOW)
    with pytest.raises(NodeError) as unreadable:  # the trainer announces its task file's digest
        task = {"kind": "math", "path": "x" * 20_000}
        long_path = RunConfig.model_validate({"run_id": "loop", "task": task})
        announced_config(long_path, key.address)
    assert unreadable.value.reason == "task_file"
    for bad in (b"[1]", b'{"b":1, "a":2}', b"not json", canonical_json({"run_id": "other"})):
        envelope = seal_announcement(key, RunAnnouncement("loop", key.address, bad, NOW), now_ms=NOW)
        with pytest.raises(RemoteProtocolError) as caught:
            TrainerTrust("loop").offer(envelope, now_ms=NOW)
        assert caught.value.reason in {"bad_run_config", "wrong_run"}


def test_other_runs_future_dates_and_config_changes_are_refused() -> None:
    key = WalletKey.generate()
    with pytest.raises(RemoteProtocolError):
        TrainerTrust("loop").offer(_announce(key, run_id="other"), now_ms=NOW)
    with pytest.raises(RemoteProtocolError) as caught:
        TrainerTrust("loop").offer(_announce(key), now_ms=NOW - 60_000)
    assert caught.value.reason == "from_the_future"
    trust = TrainerTrust("loop", pinned=key.address)
    trust.offer(_announce(key), now_ms=NOW)
    with pytest.raises(RemoteProtocolError) as caught:
        trust.offer(_announce(key, max_new_tokens=5), now_ms=NOW)
    assert caught.value.reason == "config_changed"


def test_a_worker_config_keeps_its_own_paths_and_the_trainer_address(tmp_path: object) -> None:
    key = WalletKey.generate()
    config = RunConfig(run_id="loop", model_dir="/trainer/model", output_dir="/trainer/out", max_new_tokens=6)
    announcement = RunAnnouncement("loop", key.address, announced_config(config, key.address), NOW)
    assert b"/trainer" not in announcement.config_json
    worker = worker_run_config(announcement, output_dir=tmp_path)  # type: ignore[arg-type]
    assert worker.model_dir is None and str(worker.output_dir) == str(tmp_path)
    assert worker.trainer_address == str(key.address) and worker.max_new_tokens == 6
    local = {"model_dir", "output_dir", "trainer_address"}
    same = {k: v for k, v in config.model_dump().items() if k not in local}
    assert {k: v for k, v in worker.model_dump().items() if k in same} == same


# -- gathering -------------------------------------------------------------------------------------------


def test_a_step_takes_the_oldest_admissible_policy_up_to_prompts_per_step_informative_groups() -> None:
    gatherer: StepGatherer[str] = StepGatherer(prompts_per_step=4, async_level=2)
    queued = [(2, 3, "stale"), (4, 2, "b"), (4, 1, "c"), (4, 3, "d"), (4, 1, "e"), (5, 4, "f")]
    for step, groups, name in queued:
        assert gatherer.add(Candidate(step, groups, name))
    first = gatherer.take(5)
    assert first is not None and first.policy_step == 4 and [c.item for c in first.batches] == ["b", "c", "d"]
    assert [c.item for c in first.dropped_stale] == ["stale"]
    assert gatherer.stale_in_queue == 1  # went stale while queued: its own reason, not admission's "stale"
    assert STALE_IN_QUEUE == "stale_in_queue"
    second = gatherer.take(6)
    assert second is not None and [c.item for c in second.batches] == ["e"]
    third = gatherer.take(7)
    assert third is not None and [c.item for c in third.batches] == ["f"]
    assert gatherer.take(7) is None


def test_a_step_counts_drawn_groups_so_one_full_batch_is_one_step_as_in_the_local_trainer() -> None:
    """A networked step gets the data of one local step: one batch of prompts_per_step prompts, however
    few of its groups are informative (counting only informative groups made steps of ~2 batches)."""
    gatherer: StepGatherer[str] = StepGatherer(prompts_per_step=16, async_level=2)
    for name, informative in (("a", 5), ("b", 9), ("c", 16)):
        assert gatherer.add(Candidate(3, informative, name, drawn_groups=16))
    assert gatherer.ready_groups(3) == 48
    for expected in ("a", "b", "c"):
        taken = gatherer.take(3)
        assert taken is not None and [c.item for c in taken.batches] == [expected]
    half: StepGatherer[str] = StepGatherer(prompts_per_step=16, async_level=2)
    for name in ("x", "y", "z"):  # half-size batches (fewer prompts each) fill a step two at a time
        half.add(Candidate(3, 2, name, drawn_groups=8))
    taken = half.take(3)
    assert taken is not None and [c.item for c in taken.batches] == ["x", "y"]
    assert not half.add(Candidate(3, 0, "flat", drawn_groups=16))  # nothing to train on, whatever its size


def test_ready_groups_counts_what_the_next_step_would_take() -> None:
    gatherer: StepGatherer[str] = StepGatherer(prompts_per_step=8, async_level=1)
    assert gatherer.ready_groups(3) == 0
    for step, groups in [(1, 5), (2, 3), (2, 4), (4, 6)]:
        gatherer.add(Candidate(step, groups, f"{step}-{groups}"))
    assert gatherer.ready_groups(2) == 5  # the oldest admissible policy first
    assert gatherer.ready_groups(3) == 7  # policy 1 is stale at step 3
    assert gatherer.ready_groups(5) == 6


def test_uninformative_future_and_overflowing_batches_are_not_trained_on() -> None:
    gatherer: StepGatherer[str] = StepGatherer(prompts_per_step=2, async_level=1, capacity=2)
    assert not gatherer.add(Candidate(0, 0, "flat"))
    assert gatherer.uninformative == 1
    assert gatherer.add(Candidate(3, 1, "future")) and gatherer.add(Candidate(1, 1, "now"))
    assert not gatherer.add(Candidate(1, 1, "full")) and gatherer.overflow == 1
    taken = gatherer.take(1)
    assert taken is not None and [c.item for c in taken.batches] == ["now"]
    assert gatherer.take(1) is None  # "future" waits until the trainer reaches its step
    later = gatherer.take(3)
    assert later is not None and [c.item for c in later.batches] == ["future"]


@given(
    st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6)), max_size=40),
    st.integers(1, 8),
    st.integers(0, 3),
    st.lists(st.integers(0, 14), min_size=1, max_size=20),
)
def test_gathering_never_trains_stale_future_or_mixed_policies(
    batches: list[tuple[int, int]], target: int, async_level: int, steps: list[int]
) -> None:
    gatherer: StepGatherer[int] = StepGatherer(prompts_per_step=target, async_level=async_level)
    for index, (policy, groups) in enumerate(batches):
        gatherer.add(Candidate(policy, groups, index))
    queued = len(gatherer)
    seen: set[int] = set()
    dropped: set[int] = set()
    for current in sorted(steps):
        gatherer.ready_groups(current)  # looking never drops or counts anything
        taken = gatherer.take(current)
        if taken is None:
            continue
        for candidate in taken.dropped_stale:
            assert candidate.policy_step < current - async_level
            assert candidate.item not in dropped | seen
            dropped.add(candidate.item)
        assert gatherer.stale_in_queue == len(dropped)
        if not taken.batches:
            continue
        assert {c.policy_step for c in taken.batches} == {taken.policy_step}
        assert current - async_level <= taken.policy_step <= current
        assert all(c.informative_groups > 0 for c in taken.batches)
        # only the last batch may push the step past its target
        assert sum(c.informative_groups for c in taken.batches[:-1]) < target
        ids = {c.item for c in taken.batches}
        assert not ids & seen
        seen |= ids
    # every queued batch is trained on, dropped as stale_in_queue, or still waiting: exactly one of them
    assert len(seen) + len(dropped) + len(gatherer) == queued


# -- the trainer's key and merged steps ------------------------------------------------------------------


def test_only_the_trainer_key_may_run_the_trainer() -> None:
    from prime_node.roles.trainer_key import check_trainer_key

    key, other = WalletKey.generate(), WalletKey.generate()
    config = RunConfig(run_id="loop", trainer_address=str(other.address))
    with pytest.raises(NodeError) as caught:
        check_trainer_key(config, key)
    assert caught.value.reason == "not_trainer" and str(other.address) in str(caught.value)
    assert check_trainer_key(RunConfig(run_id="loop"), key).trainer_address == str(key.address)
    lower = RunConfig(run_id="loop", trainer_address=str(key.address).lower())
    assert check_trainer_key(lower, key) is lower


def test_merged_batches_keep_every_sample_and_weigh_rewards_by_size() -> None:
    from prime_node.ml.prepared import Prepared
    from prime_node.ml.session import merge_prepared

    a = Prepared(3, [[1, 2]], [1], [0.5], 1.0, 1, 1)
    b = Prepared(3, [[4, 5], [6, 7]], [1, 1], [-1.0, 1.0], 0.0, 2, 0)
    merged = merge_prepared([a, b])
    assert merged.sequences == [[1, 2], [4, 5], [6, 7]] and merged.advantages == [0.5, -1.0, 1.0]
    assert merged.groups_kept == 3 and merged.groups_dropped == 1
    assert merged.reward_mean == pytest.approx(0.5)
    with pytest.raises(ValueError):
        merge_prepared([a, Prepared(4, [], [], [], 0.0, 0, 0)])


def test_the_backlog_is_batches_without_a_verdict_in_the_window() -> None:
    from prime_node.roles.demand_taps import BacklogMeter

    meter = BacklogMeter(window_s=10.0)
    for i in range(5):
        meter.rollout(bytes([i]) * 32, now=float(i))
    meter.rollout(bytes([0]) * 32, now=5.0)  # heard again: counted once
    meter.verdict(bytes([1]) * 32)
    meter.verdict(bytes([1]) * 32)  # a second validator's verdict on the same batch
    meter.verdict(bytes([9]) * 32)  # a verdict before its batch arrived
    meter.rollout(bytes([9]) * 32, now=5.0)
    assert meter.backlog(5.0) == 4
    assert meter.backlog(12.5) == 2  # batches 0 and 2 (heard at 0 s and 2 s) left the window


def _math_run(path: Path, key: WalletKey) -> RunAnnouncement:
    config = RunConfig.model_validate({"run_id": "loop", "task": {"kind": "math", "path": str(path)}})
    return RunAnnouncement("loop", key.address, announced_config(config, key.address), NOW)


def test_a_task_file_is_announced_by_name_and_digest_and_read_only_from_the_workers_own_copy(
    tmp_path: Path,
) -> None:
    key = WalletKey.generate()
    tasks = tmp_path / "trainer" / "secret-dir" / "gsm.jsonl"
    tasks.parent.mkdir(parents=True)
    tasks.write_text('{"question": "1+1", "answer": "2"}\n')
    announcement = _math_run(tasks, key)
    assert b"secret-dir" not in announcement.config_json  # the trainer's layout does not travel
    task_dir = tmp_path / "worker" / "tasks"
    with pytest.raises(NodeError) as missing:
        worker_run_config(announcement, task_dir=task_dir)
    assert missing.value.reason == "task_file" and str(task_dir / "gsm.jsonl") in str(missing.value)
    task_dir.mkdir(parents=True)
    (task_dir / "gsm.jsonl").write_text('{"question": "1+1", "answer": "3"}\n')
    with pytest.raises(NodeError) as other:
        worker_run_config(announcement, task_dir=task_dir)
    assert "not the run's task file" in str(other.value)
    (task_dir / "gsm.jsonl").write_bytes(tasks.read_bytes())
    worker = worker_run_config(announcement, task_dir=task_dir)
    assert worker.task.path == task_dir / "gsm.jsonl" and worker.task.kind == "math"


@pytest.mark.parametrize(
    "task",
    [{"path": "../../home/user/.ssh/id_rsa"}, {"path": "/etc/passwd"}, {"path": "gsm.jsonl", "digest": None}],
)
def test_an_announced_task_path_never_names_a_file_of_the_workers(
    tmp_path: Path, task: dict[str, Any]
) -> None:
    """Even the pinned trainer's announcement cannot make a worker open a path of its choosing."""
    key = WalletKey.generate()
    (tmp_path / "gsm.jsonl").write_text("{}\n")
    config = {
        "run_id": "loop",
        "task": {"kind": "math", "path": task["path"]},
        "trainer_address": str(key.address),
    }
    if task.get("digest", "x") is not None:
        config["task_file_sha256"] = "0" * 64
    announcement = RunAnnouncement("loop", key.address, canonical_json(config), NOW)
    with pytest.raises(NodeError) as caught:
        worker_run_config(announcement, task_dir=tmp_path)
    assert caught.value.reason == "task_file"
