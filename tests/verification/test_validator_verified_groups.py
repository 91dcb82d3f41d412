"""Issue 13: what a validator that recomputes a secret sample of groups vouches for and executes, and the
cheap header checks that refuse a mis-shaped batch before its samples are decoded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prime_node.testing.adversary import build_scenario, validator_for
from prime_node.verification.cheating import Scenario
from prime_node.verification.proving import rollout_domain
from prime_node.verification.reasons import Reason
from prime_node.verification.validator import CheckPolicy
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.errors import InvariantError, RemoteProtocolError
from protocol.verdict import Verdict
from tests.verification.code_attack import code_run, marker_dir, unsampled_hostile_frame


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def markers() -> Iterator[Path]:
    with marker_dir() as path:
        yield path


def test_a_hostile_group_outside_the_sample_is_never_executed_nor_vouched_for(
    tmp_path: Path, markers: Path
) -> None:
    run = code_run(tmp_path, markers)
    scenario = run.scenario
    validator = validator_for(scenario)
    validator.policy = CheckPolicy(recompute_groups=1)
    frame, hostile = unsampled_hostile_frame(run, validator)
    result = validator.validate_frame(frame, now_ms=scenario.now_ms, current_step=scenario.current_step)
    assert result.accepted, result.detail  # the sampled replay passed: the price of sampling
    assert not run.executed_hostile(), "the validator executed a completion it never replayed"
    assert list(run.markers.iterdir()) == []
    group_size = scenario.config.group_size
    assert len(run.task.scored) == group_size  # the replayed group, and only it, was scored
    assert hostile not in result.verified_groups and len(result.verified_groups) == 1
    verdict = result.verdict()
    assert verdict is not None
    assert verdict.verified_groups == tuple(result.verified_groups)
    assert len(verdict.rewards) == group_size


def test_without_sampling_every_group_is_verified_and_scored() -> None:
    scenario = build_scenario(group_size=2, groups=3, max_new_tokens=6)
    result = validator_for(scenario).validate_frame(
        scenario.honest_frames(0)[0], now_ms=scenario.now_ms, current_step=scenario.current_step
    )
    assert result.accepted and result.verified_groups == [0, 1, 2]
    verdict = result.verdict()
    assert verdict is not None and verdict.verified_groups == (0, 1, 2) and len(verdict.rewards) == 6


def _header_then_junk(scenario: Scenario, *, samples: int, junk: int) -> bytes:
    """A sealed frame whose batch header is this run's (worker, step, temperature, group size) and
    declares ``samples`` samples, followed by ``junk`` bytes no decoder accepts (0xc1 is never used)."""
    config = scenario.config
    scalars = [1, config.run_id, scenario.key.address.raw, scenario.current_step, 0, config.temperature]
    head = b"\x93" + msgpack.packb(1) + msgpack.packb("rollout.batch") + b"\x98"
    head += b"".join(msgpack.packb(v, use_bin_type=True) for v in [*scalars, config.group_size])
    head += b"\xdc" + samples.to_bytes(2, "big")
    payload = head + b"\xc1" * junk
    return encode(seal(scenario.key, rollout_domain(config.run_id), payload, now_ms=scenario.now_ms))


@pytest.mark.parametrize(
    ("samples", "junk", "why"),
    [(4096, 4096 * 300, "4,096 samples"), (8, 4 << 20, "the run's count but 4 MiB")],
)
def test_a_batch_of_the_wrong_count_or_size_is_refused_on_its_header_and_charged(
    samples: int, junk: int, why: str
) -> None:
    scenario = build_scenario()  # 2 groups of 4: 8 samples
    frame = _header_then_junk(scenario, samples=samples, junk=junk)
    result = validator_for(scenario).validate_frame(
        frame, now_ms=scenario.now_ms, current_step=scenario.current_step
    )
    # Judged on its header alone: decoding the samples would have said malformed_batch.
    assert result.reasons == [Reason.WRONG_SHAPE], (why, result.reasons, result.detail)
    assert result.batch is None
    verdict = result.verdict()  # names the worker, so every node that hears it charges it
    assert verdict is not None and not verdict.accepted and verdict.worker == scenario.key.address
    assert verdict.reasons == ("wrong_shape",) and verdict.verified_groups == ()


def test_an_honest_batch_is_within_the_size_bound_and_its_header_peeks_as_decoded() -> None:
    from protocol.rollouts import BatchHeader, peek_header

    scenario = build_scenario(max_new_tokens=40)
    batch = scenario.batch(0)
    payload = encode(batch)
    assert peek_header(payload) == BatchHeader.of(batch)
    validator = validator_for(scenario)
    assert len(payload) <= validator._size_limit(BatchHeader.of(batch))


@given(st.binary(max_size=300))
def test_random_bytes_peek_as_a_header_or_raise_remote_protocol_error(data: bytes) -> None:
    from protocol.rollouts import peek_header

    try:
        header = peek_header(data)
    except RemoteProtocolError as exc:
        assert exc.reason == "malformed"
        return
    assert 1 <= header.group_size <= 1024 and isinstance(header.run_id, str)


def test_a_scalar_slot_holding_an_array_is_refused_without_unpacking_it() -> None:
    from protocol.rollouts import peek_header

    huge = msgpack.packb([1, "rollout.batch", [1, list(range(100_000))]])
    with pytest.raises(RemoteProtocolError):
        peek_header(huge)


def test_verified_groups_ascend_and_a_rejection_vouches_for_none() -> None:
    base = build_scenario().batch(0)
    fields = dict(
        run_id="adversary",
        batch_id=b"\x01" * 32,
        worker=base.worker,
        policy_step=1,
        batch_counter=0,
        rejected_samples=(),
        rewards=(),
    )
    ok = Verdict(**fields, accepted=True, reasons=(), verified_groups=(0, 3))  # type: ignore[arg-type]
    assert decode(encode(ok), Verdict) == ok
    with pytest.raises(InvariantError):
        Verdict(**fields, accepted=True, reasons=(), verified_groups=(3, 0))  # type: ignore[arg-type]
    with pytest.raises(InvariantError):
        Verdict(**fields, accepted=True, reasons=(), verified_groups=(1, 1))  # type: ignore[arg-type]
    with pytest.raises(InvariantError):
        Verdict(**fields, accepted=False, reasons=("replay",), verified_groups=(0,))  # type: ignore[arg-type]
