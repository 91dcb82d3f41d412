"""Properties of the GRPO loss: advantages, clipping bounds, where gradients vanish, normalisation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prime_node.ml.grpo import (
    OBJECTIVES,
    LossParts,
    Objective,
    clipped_objective,
    group_advantages,
    grpo_loss,
    masked_is_objective,
    truncated_is_weight,
)

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
    ).backward()  # type: ignore[no-untyped-call]
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
    parts.loss.backward()  # type: ignore[no-untyped-call]
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
    ).loss.backward()  # type: ignore[no-untyped-call]
    reference = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(reference, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (-(logp * adv.unsqueeze(-1) * mask).sum() / 3.0).backward()  # type: ignore[no-untyped-call]
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
    whole = logits.clone().requires_grad_(True)
    _backward(_loss(whole, targets, old, adv, mask, normalizer=float(mask.sum()), entropy_coef=0.01))
    split = logits.clone().requires_grad_(True)
    for part in (slice(0, 1), slice(1, 4)):
        _backward(
            _loss(
                split[part],
                targets[part],
                old[part],
                adv[part],
                mask[part],
                normalizer=float(mask.sum()),
                entropy_coef=0.01,
            )
        )
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


# -- off-policy objectives (decoupled PPO, masked IS) ----------------------------------------------------

TEMPERATURE = 0.7


def _token_logp(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _backward(parts: LossParts) -> None:
    parts.loss.backward()  # type: ignore[no-untyped-call]


def _loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    old: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    normalizer: float,
    objective: Objective = "recompute",
    behaviour: torch.Tensor | None = None,
    is_cap: float = 2.0,
    is_mask_low: float = 0.5,
    is_mask_high: float = 2.0,
    is_kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
) -> LossParts:
    return grpo_loss(
        logits,
        targets,
        old,
        adv,
        mask,
        normalizer=normalizer,
        temperature=TEMPERATURE,
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        delta=DELTA,
        entropy_coef=entropy_coef,
        objective=objective,
        behaviour_logp=behaviour,
        is_cap=is_cap,
        is_mask_low=is_mask_low,
        is_mask_high=is_mask_high,
        is_kl_coef=is_kl_coef,
    )


def _case(
    seed: int, batch: int = 3, length: int = 4, vocab: int = 6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, targets, a completion mask, advantages, and the log-probs of a behaviour policy some
    updates away (the same logits, perturbed)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=gen)
    targets = torch.randint(0, vocab, (batch, length), generator=gen)
    mask = (torch.rand(batch, length, generator=gen) > 0.3).float()
    mask[:, -1] = 1.0  # at least one completion token per row
    adv = torch.randn(batch, generator=gen)
    behaviour = _token_logp(logits + 0.8 * torch.randn(batch, length, vocab, generator=gen), targets)
    return logits, targets, mask, adv, behaviour


@given(st.integers(0, 10_000), st.sampled_from(["behaviour", "decoupled", "masked_is"]))
def test_with_behaviour_equal_to_proximal_the_off_policy_objectives_are_on_policy(
    seed: int, objective: Objective
) -> None:
    logits, targets, mask, adv, _ = _case(seed)
    on_policy = logits.clone().requires_grad_(True)
    ref = _loss(on_policy, targets, None, adv, mask, normalizer=float(mask.sum()))
    _backward(ref)
    off = logits.clone().requires_grad_(True)
    parts = _loss(
        off,
        targets,
        None,
        adv,
        mask,
        normalizer=float(mask.sum()),
        objective=objective,
        behaviour=_token_logp(logits, targets),
        is_kl_coef=0.1,  # (log r)^2 has zero value and zero gradient at r = 1
    )
    _backward(parts)
    assert off.grad is not None and on_policy.grad is not None
    assert torch.allclose(parts.loss, ref.loss, atol=1e-6)
    assert torch.allclose(off.grad, on_policy.grad, atol=1e-6)
    assert parts.is_fraction == 0.0


@given(st.integers(0, 10_000))
def test_the_behaviour_objective_is_recompute_with_the_behaviour_log_probs_as_old(seed: int) -> None:
    """What makes "behaviour" safe to use instead of "recompute": given the same old log-probs (the
    validator guarantees mu matches the generating policy's prefill), loss and gradient are the same."""
    logits, targets, mask, adv, behaviour = _case(seed)
    recomputed = logits.clone().requires_grad_(True)
    ref = _loss(recomputed, targets, behaviour, adv, mask, normalizer=float(mask.sum()))
    _backward(ref)
    verified = logits.clone().requires_grad_(True)
    parts = _loss(
        verified,
        targets,
        None,
        adv,
        mask,
        normalizer=float(mask.sum()),
        objective="behaviour",
        behaviour=behaviour,
    )
    _backward(parts)
    assert verified.grad is not None and recomputed.grad is not None
    assert torch.allclose(parts.loss, ref.loss, atol=1e-6)
    assert torch.allclose(verified.grad, recomputed.grad, atol=1e-6)
    assert parts.clipped_fraction == ref.clipped_fraction


@given(st.floats(-30, 30), st.floats(-30, 30), st.floats(1.0, 10.0))
def test_the_is_weight_never_exceeds_the_cap_and_has_no_gradient(
    prox: float, behaviour: float, cap: float
) -> None:
    weight = truncated_is_weight(
        torch.tensor(prox, requires_grad=True), torch.tensor(behaviour, requires_grad=True), cap
    )
    assert not weight.requires_grad and bool(torch.isfinite(weight))
    assert 0.0 <= float(weight) <= cap * (1 + 1e-6)
    expected = min(math.exp(min(prox - behaviour, 50.0)), cap)
    assert abs(float(weight) - expected) <= 1e-5 * max(1.0, expected)


@given(st.integers(0, 10_000))
def test_decoupled_gradient_is_the_weighted_on_policy_gradient_and_ignores_the_behaviour(seed: int) -> None:
    logits, targets, mask, adv, behaviour = _case(seed)
    behaviour = behaviour.clone().requires_grad_(True)
    off = logits.clone().requires_grad_(True)
    parts = _loss(
        off,
        targets,
        None,
        adv,
        mask,
        normalizer=float(mask.sum()),
        objective="decoupled",
        behaviour=behaviour,
        is_cap=2.0,
    )
    _backward(parts)
    assert behaviour.grad is None  # no gradient reaches the behaviour log-probs
    truncated = (_token_logp(logits, targets) - behaviour.detach()) >= math.log(2.0)
    assert abs(parts.is_fraction - float((truncated * mask).sum() / mask.sum())) < 1e-6
    # pi_prox = pi_theta, so the PPO ratio is 1: the gradient is w · A · grad log pi with w = min(pi/mu, 2)
    reference = logits.clone().requires_grad_(True)
    logp = _token_logp(reference, targets)
    weight = torch.exp(logp.detach() - behaviour.detach()).clamp(max=2.0)
    surrogate = -(weight * logp * adv.unsqueeze(-1) * mask).sum() / float(mask.sum())
    surrogate.backward()  # type: ignore[no-untyped-call]
    assert off.grad is not None and reference.grad is not None
    assert torch.allclose(off.grad, reference.grad, atol=1e-5)


@given(st.integers(0, 10_000), st.floats(0.1, 1.0), st.floats(1.0, 10.0))
def test_masked_is_tokens_outside_the_band_carry_no_gradient(seed: int, low: float, high: float) -> None:
    logits, targets, _, adv, behaviour = _case(seed, batch=1, length=6)
    log_ratio = _token_logp(logits, targets) - behaviour
    outside = (log_ratio < math.log(low)) | (log_ratio > math.log(high))
    for position in range(6):
        # one completion token at a time, so a position's logits see only that token's loss
        only = torch.zeros(1, 6)
        only[0, position] = 1.0
        leaf = logits.clone().requires_grad_(True)
        parts = _loss(
            leaf,
            targets,
            None,
            adv,
            only,
            normalizer=1.0,
            objective="masked_is",
            behaviour=behaviour,
            is_mask_low=low,
            is_mask_high=high,
        )
        _backward(parts)
        assert leaf.grad is not None and bool(torch.isfinite(leaf.grad).all())
        zero = bool((leaf.grad == 0).all())
        if bool(outside[0, position]):
            assert zero and parts.is_fraction == 1.0
        elif float(adv[0]) != 0.0:
            assert not zero and parts.is_fraction == 0.0


@given(st.floats(-80, 80), st.floats(-3, 3))
def test_masked_is_stays_finite_for_extreme_ratios(log_ratio: float, advantage: float) -> None:
    logp = torch.tensor([[log_ratio - 40.0]], requires_grad=True)
    j, kept = masked_is_objective(
        logp, torch.tensor([[-40.0]]), torch.tensor([[advantage]]), low=0.5, high=2.0
    )
    j.sum().backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None and bool(torch.isfinite(logp.grad).all()) and bool(torch.isfinite(j).all())
    log_r = float(logp.detach() - (-40.0))
    assert bool(kept) == (math.log(0.5) <= log_r <= math.log(2.0))


@given(st.integers(0, 10_000), st.sampled_from(OBJECTIVES))
def test_off_policy_micro_batches_with_the_global_normaliser_equal_one_batch(
    seed: int, objective: Objective
) -> None:
    logits, targets, mask, adv, behaviour = _case(seed, batch=4, length=5)
    old = behaviour if objective == "recompute" else None  # recompute: the generating policy's log-probs
    normalizer = float(mask.sum())

    def loss(part: slice, leaf: torch.Tensor) -> LossParts:
        return _loss(
            leaf[part],
            targets[part],
            None if old is None else old[part],
            adv[part],
            mask[part],
            normalizer=normalizer,
            objective=objective,
            behaviour=behaviour[part],
            is_kl_coef=0.05,
            entropy_coef=0.01,
        )

    whole = logits.clone().requires_grad_(True)
    total = loss(slice(0, 4), whole)
    _backward(total)
    split = logits.clone().requires_grad_(True)
    loss_sum, is_sum = 0.0, 0.0
    for part in (slice(0, 1), slice(1, 4)):
        parts = loss(part, split)
        _backward(parts)
        loss_sum += float(parts.loss.detach())
        is_sum += parts.is_fraction
    assert whole.grad is not None and split.grad is not None
    assert torch.allclose(whole.grad, split.grad, atol=1e-6)
    assert abs(float(total.loss.detach()) - loss_sum) < 1e-5 and abs(total.is_fraction - is_sum) < 1e-6


@given(st.integers(0, 10_000), st.sampled_from(OBJECTIVES))
def test_tokens_outside_the_completion_mask_carry_no_gradient_for_any_objective(
    seed: int, objective: Objective
) -> None:
    logits, targets, mask, adv, behaviour = _case(seed)
    leaf = logits.clone().requires_grad_(True)
    _backward(
        _loss(
            leaf,
            targets,
            behaviour if objective == "recompute" else None,
            adv,
            mask,
            normalizer=float(mask.sum()),
            objective=objective,
            behaviour=behaviour,
            is_kl_coef=0.1,
        )
    )
    assert leaf.grad is not None
    assert torch.count_nonzero(leaf.grad[mask == 0]) == 0


@pytest.mark.parametrize("objective", ["decoupled", "masked_is"])
def test_the_off_policy_objectives_refuse_to_run_without_behaviour_log_probs(objective: Objective) -> None:
    logits, targets, mask, adv, _ = _case(0)
    with pytest.raises(ValueError, match="behaviour"):
        _loss(logits, targets, None, adv, mask, normalizer=1.0, objective=objective)
