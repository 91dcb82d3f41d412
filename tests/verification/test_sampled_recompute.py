"""Recomputing a secret sample of groups (``CheckPolicy.recompute_groups``): which samples are checked, and
what that does and does not catch, on a real tiny model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from prime_node.testing.adversary import build_scenario, validator_for
from prime_node.verification.validator import CheckPolicy
from protocol.rollouts import RolloutBatch


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_the_sample_is_whole_groups_fixed_by_the_validators_key_and_the_batch() -> None:
    scenario = build_scenario(group_size=2, groups=4, max_new_tokens=6)
    validator = validator_for(scenario)
    validator.policy = CheckPolicy(recompute_groups=2)
    batch = scenario.batch(0)
    chosen = validator.recomputed_samples(batch, b"\x01" * 32)
    assert chosen == validator.recomputed_samples(batch, b"\x01" * 32)
    assert len(chosen) == 4 and all(chosen[i] // 2 == chosen[i + 1] // 2 for i in (0, 2))
    others = {tuple(validator.recomputed_samples(batch, bytes([i]) * 32)) for i in range(40)}
    assert len(others) > 1  # the draw depends on the batch id
    another = validator_for(scenario)
    another.policy = validator.policy
    draws = [
        validator.recomputed_samples(batch, bytes([i]) * 32)
        == another.recomputed_samples(batch, bytes([i]) * 32)
        for i in range(40)
    ]
    assert not all(draws)  # and on the validator's own secret key
    validator.policy = CheckPolicy(recompute_groups=0)
    assert validator.recomputed_samples(batch, b"\x01" * 32) == list(range(8))


def test_a_cheat_in_a_checked_group_is_caught_and_one_outside_the_sample_is_not() -> None:
    scenario = build_scenario(group_size=2, groups=4, max_new_tokens=6)
    validator = validator_for(scenario)
    validator.policy = CheckPolicy(recompute_groups=1)
    batch = scenario.batch(3)
    batch_id = b"\x00" * 32  # what check_batch names a batch it was handed directly
    checked = validator.recomputed_samples(batch, batch_id)
    unchecked = next(i for i in range(len(batch.samples)) if i not in checked)

    def with_forged_proof(number: int) -> RolloutBatch:
        samples = list(batch.samples)
        chunks = len(samples[number].proof) // 258
        zero_poly = (b"\xff\xd9" + bytes(256)) * chunks  # well-formed (modulus 65497), committing to zeros
        samples[number] = replace(samples[number], proof=zero_poly)
        return replace(batch, samples=tuple(samples))

    caught = validator.check_batch(with_forged_proof(checked[0]), current_step=scenario.current_step)
    assert not caught.accepted and checked[0] in caught.rejected_samples
    missed = validator.check_batch(with_forged_proof(unchecked), current_step=scenario.current_step)
    assert missed.accepted  # the documented price of sampling: (1 − c/G)-ish per check
