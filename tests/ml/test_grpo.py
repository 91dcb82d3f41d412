"""Properties of the GRPO loss: advantages, clipping bounds, where gradients vanish, normalisation."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from prime_node.ml.grpo import clipped_objective, group_advantages, grpo_loss

EPS_LOW, EPS_HIGH, DELTA = 0.2, 0.28, 4.0
finite = st.floats(-5, 5, allow_nan=False, allow_infinity=False)


@given(st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=4, max_size=4), min_size=1, max_size=6))
def test_advantages_are_centred_scaled_and_zero_for_constant_groups(rows: list[list[float]]) -> None:
    rewards = torch.tensor(rows, dtype=torch.float64)
    adv = group_advantages(rewards)
    for g, row in enumerate(rows):
        if len(set(row)) == 1:
            assert torch.equal(adv[g], torch.zeros(4, dtype=torch.float64))
        else:
            assert abs(float(adv[g].mean())) < 1e-9
            assert abs(float(adv[g].std(unbiased=False)) - 1.0) < 1e-4
            better = [i for i in range(4) if row[i] == max(row)]
            assert all(float(adv[g, i]) > 0 for i in better)


@given(finite, st.floats(-3, 3))
def test_objective_is_bounded_on_both_sides(log_ratio: float, advantage: float) -> None:
    j = float(
        clipped_objective(
            torch.tensor(log_ratio),
            torch.tensor(0.0),
            torch.tensor(advantage),
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            delta=DELTA,
        )
    )
    if advantage >= 0:
        assert j <= (1 + EPS_HIGH) * advantage + 1e-6
    else:
        assert j >= DELTA * advantage - 1e-6  # the cap delta bounds the loss of a negative advantage


def _grad(log_ratio: float, advantage: float) -> float:
    logp = torch.tensor(log_ratio, requires_grad=True)
    clipped_objective(
        logp, torch.tensor(0.0), torch.tensor(advantage), eps_low=EPS_LOW, eps_high=EPS_HIGH, delta=DELTA
    ).backward()
    assert logp.grad is not None
    return float(logp.grad)


@given(st.floats(-4, 4))
def test_gradient_vanishes_exactly_where_clipping_applies(log_ratio: float) -> None:
    ratio = float(torch.exp(torch.tensor(log_ratio)))
    # positive advantage: no push beyond 1 + eps_high
    assert (_grad(log_ratio, 1.0) == 0.0) == (ratio > 1 + EPS_HIGH)
    # negative advantage: no push below 1 - eps_low, and nothing beyond the cap delta
    assert (_grad(log_ratio, -1.0) == 0.0) == (ratio < 1 - EPS_LOW or ratio > DELTA)


@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 1000))
def test_zero_advantage_gives_zero_gradient(batch: int, length: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, 7, generator=gen, requires_grad=True)
    targets = torch.randint(0, 7, (batch, length), generator=gen)
    old = torch.randn(batch, length, generator=gen).clamp(max=0) - 1
    parts = grpo_loss(
        logits,
        targets,
        old,
        torch.zeros(batch),
        torch.ones(batch, length),
        normalizer=batch * length,
        temperature=1.0,
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        delta=DELTA,
    )
    parts.loss.backward()
    assert logits.grad is not None and torch.count_nonzero(logits.grad) == 0


def test_on_policy_gradient_is_the_policy_gradient_and_masked_tokens_do_not_count() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=gen, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3), generator=gen)
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]])
    old = torch.log_softmax(logits.detach(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    adv = torch.tensor([1.5, -0.5])
    grpo_loss(
        logits,
        targets,
        old,
        adv,
        mask,
        normalizer=3.0,
        temperature=1.0,
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        delta=DELTA,
    ).loss.backward()
    reference = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(reference, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (-(logp * adv.unsqueeze(-1) * mask).sum() / 3.0).backward()
    assert logits.grad is not None and reference.grad is not None
    assert torch.allclose(logits.grad, reference.grad, atol=1e-6)
    assert torch.count_nonzero(logits.grad[0, 0]) == 0  # a prompt position


def test_micro_batches_with_a_global_normaliser_equal_one_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 5, 6, generator=gen)
    targets = torch.randint(0, 6, (4, 5), generator=gen)
    old = (
        torch.log_softmax(torch.randn(4, 5, 6, generator=gen), -1)
        .gather(-1, targets.unsqueeze(-1))
        .squeeze(-1)
    )
    mask = (torch.rand(4, 5, generator=gen) > 0.3).float()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    kwargs = dict(temperature=0.7, eps_low=EPS_LOW, eps_high=EPS_HIGH, delta=DELTA, entropy_coef=0.01)
    whole = logits.clone().requires_grad_(True)
    grpo_loss(whole, targets, old, adv, mask, normalizer=float(mask.sum()), **kwargs).loss.backward()  # type: ignore[arg-type]
    split = logits.clone().requires_grad_(True)
    for part in (slice(0, 1), slice(1, 4)):
        grpo_loss(
            split[part],
            targets[part],
            old[part],
            adv[part],
            mask[part],
            normalizer=float(mask.sum()),
            **kwargs,
        ).loss.backward()  # type: ignore[arg-type]
    assert whole.grad is not None and split.grad is not None
    assert torch.allclose(whole.grad, split.grad, atol=1e-6)


def test_kl_term_is_zero_at_the_reference_and_positive_away_from_it() -> None:
    logits = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, 6, (1, 4), generator=torch.Generator().manual_seed(3))
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    common = dict(
        normalizer=4.0, temperature=1.0, eps_low=EPS_LOW, eps_high=EPS_HIGH, delta=DELTA, kl_coef=0.1
    )
    same = grpo_loss(logits, targets, logp, torch.ones(1), torch.ones(1, 4), ref_logp=logp, **common)  # type: ignore[arg-type]
    assert abs(same.kl) < 1e-7
    other = grpo_loss(logits, targets, logp, torch.ones(1), torch.ones(1, 4), ref_logp=logp - 0.5, **common)  # type: ignore[arg-type]
    assert other.kl > 0
