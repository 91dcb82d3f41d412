"""The learning-rate schedule: a pure function of the step (so resuming and every rank agree)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prime_node.ml.lr_schedule import learning_rate_at

BASE = 5e-4
schedules = st.sampled_from(["constant", "linear", "cosine"])


def test_cosine_starts_at_the_base_rate_passes_the_midpoint_and_ends_at_the_floor() -> None:
    rate = lambda step: learning_rate_at(step, base=BASE, schedule="cosine", total_steps=300, min_ratio=0.1)  # noqa: E731
    assert rate(0) == pytest.approx(BASE)
    assert rate(150) == pytest.approx(BASE * (0.1 + 0.9 * 0.5))
    assert rate(300) == pytest.approx(BASE * 0.1)
    assert rate(10_000) == pytest.approx(BASE * 0.1)  # held at the floor past the planned end


def test_linear_decays_in_equal_steps() -> None:
    rates = [learning_rate_at(s, base=1.0, schedule="linear", total_steps=4) for s in range(5)]
    assert rates == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_warmup_rises_linearly_to_the_base_rate_then_the_schedule_starts() -> None:
    rates = [
        learning_rate_at(k, base=1.0, schedule="cosine", total_steps=14, warmup_steps=4) for k in range(6)
    ]
    assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert rates[4] == pytest.approx(1.0)  # first step of the decay
    assert rates[5] < 1.0


@given(
    schedule=schedules,
    total=st.integers(0, 5000),
    warmup=st.integers(0, 200),
    min_ratio=st.floats(0, 1),
    step=st.integers(0, 10_000),
)
def test_the_rate_is_finite_positive_and_never_above_the_base(
    schedule: str, total: int, warmup: int, min_ratio: float, step: int
) -> None:
    rate = learning_rate_at(
        step,
        base=BASE,
        schedule=schedule,
        total_steps=total,
        warmup_steps=warmup,
        min_ratio=min_ratio,  # type: ignore[arg-type]
    )
    assert math.isfinite(rate)
    assert rate <= BASE * (1 + 1e-12)
    assert rate >= 0
    if step >= warmup:
        assert rate >= BASE * min_ratio * (1 - 1e-12)


@given(schedule=schedules, total=st.integers(1, 2000), min_ratio=st.floats(0, 1), step=st.integers(0, 3000))
def test_after_warmup_the_rate_never_rises(schedule: str, total: int, min_ratio: float, step: int) -> None:
    def rate(s: int) -> float:
        return learning_rate_at(s, base=BASE, schedule=schedule, total_steps=total, min_ratio=min_ratio)  # type: ignore[arg-type]

    assert rate(step + 1) <= rate(step) * (1 + 1e-12)
