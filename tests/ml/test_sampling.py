from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from prime_node.ml.sampling import (
    choose_tokens,
    gumbel_noise,
    gumbel_noise_torch,
    replay_margin,
    token_logprobs,
)

seeds = st.integers(0, (1 << 63) - 1)


@given(st.lists(seeds, min_size=1, max_size=6), st.integers(0, 4000), st.integers(2, 50))
def test_noise_is_a_pure_function_of_seed_position_and_index(
    batch: list[int], position: int, vocab: int
) -> None:
    together = gumbel_noise(batch, [position] * len(batch), vocab)
    for row, seed in enumerate(batch):
        alone = gumbel_noise([seed], [position], vocab)[0]
        assert np.array_equal(together[row], alone)
        assert np.array_equal(gumbel_noise([seed], [position], vocab + 5)[0][:vocab], alone)
    assert np.isfinite(together).all()


@given(st.lists(seeds, min_size=1, max_size=6), st.lists(st.integers(0, 1 << 20), min_size=6, max_size=6))
def test_the_device_noise_is_the_rule_bit_for_bit_before_the_logs(
    batch: list[int], positions: list[int]
) -> None:
    """The GPU path (run here on the CPU's int64 kernels) hashes exactly as numpy's uint64 rule; the two
    float64 logs may differ only in the last bits."""
    at = positions[: len(batch)]
    ours = gumbel_noise_torch(batch, at, 97, "cpu").numpy()
    rule = gumbel_noise(batch, at, 97)
    # -ln(-ln(u)) is strictly increasing in u, so equal hash bits give equal order; values within 1e-12.
    assert np.allclose(ours, rule, rtol=0, atol=1e-12)
    assert (np.argsort(ours, axis=1, kind="stable") == np.argsort(rule, axis=1, kind="stable")).all()


def test_noise_changes_with_seed_and_position() -> None:
    base = gumbel_noise([7], [0], 64)
    assert not np.array_equal(base, gumbel_noise([8], [0], 64))
    assert not np.array_equal(base, gumbel_noise([7], [1], 64))


def test_seeded_choice_samples_from_the_tempered_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    temperature = 0.7
    n = 20000
    chosen = choose_tokens(logits.expand(n, 4), list(range(n)), [3] * n, temperature)
    observed = torch.bincount(chosen, minlength=4).double() / n
    expected = torch.softmax(logits[0].double() / temperature, -1)
    assert torch.allclose(observed, expected, atol=0.015), (observed, expected)


def test_zero_temperature_is_greedy_and_logprobs_match_log_softmax() -> None:
    logits = torch.randn(5, 11)
    tokens = choose_tokens(logits, [1, 2, 3, 4, 5], [0] * 5, 0.0)
    assert torch.equal(tokens, logits.argmax(-1))
    lp = token_logprobs(logits, tokens, 2.0)
    assert torch.allclose(lp, torch.log_softmax(logits / 2.0, -1).gather(-1, tokens.view(-1, 1)).squeeze(-1))


@given(seeds, st.integers(0, 100))
def test_replay_margin_is_zero_for_the_rule_and_positive_for_another_token(seed: int, position: int) -> None:
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(seed % 1000))
    token = int(choose_tokens(logits, [seed], [position], 1.0)[0])
    assert float(replay_margin(logits, [seed], [position], 1.0, [token])[0]) == 0.0
    other = (token + 1) % 16
    assert float(replay_margin(logits, [seed], [position], 1.0, [other])[0]) > 0.0
    assert math.isfinite(float(replay_margin(logits, [seed], [position], 1.0, [other])[0]))
