from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
import torch

from prime_node.ml.engine import SamplingParams, TorchEngine, cache_keyword
from prime_node.ml.model import load_model
from prime_node.ml.sampling import replay_margin, token_logprobs
from prime_node.ml.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> TorchEngine:
    tokenizer = load_tokenizer(tiny_model_dir)
    return TorchEngine(
        load_model(tiny_model_dir), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )


PROMPTS = [[22, 23, 16, 24, 25, 34], [29, 16, 27, 34], [30, 31, 32, 16, 22, 34, 22]]


def test_generation_is_replayable_and_independent_of_batch_company(engine: TorchEngine) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=1.0, return_hidden=True)
    batch = engine.generate(PROMPTS, [11, 12, 13], params)
    again = engine.generate(PROMPTS, [11, 12, 13], params)
    assert [c.tokens for c in batch] == [c.tokens for c in again]
    for prompt, seed, completion in zip(PROMPTS, [11, 12, 13], batch, strict=True):
        alone = engine.generate([prompt], [seed], params)[0]
        assert alone.tokens == completion.tokens
        assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(completion.logprobs), atol=1e-5)
        assert completion.hidden is not None and completion.hidden.shape == (len(completion.tokens), 64)
        assert len(completion.logprobs) == len(completion.tokens) <= 12
        assert completion.finished == (completion.tokens[-1] == engine.eos_token_id)
        assert engine.eos_token_id not in completion.tokens[:-1]
    assert engine.generate(PROMPTS, [11, 12, 99], params)[2].tokens != batch[2].tokens


def test_prefill_reproduces_generation_for_a_validator(engine: TorchEngine) -> None:
    """What a validator does: prefill prompt + completion, compare log-probs, hidden states and the rule."""
    seeds = [5, 6, 7]
    params = SamplingParams(max_new_tokens=16, temperature=0.8, return_hidden=True)
    completions = engine.generate(PROMPTS, seeds, params)
    prefills = engine.prefill(PROMPTS, [c.tokens for c in completions])
    for seed, completion, prefill in zip(seeds, completions, prefills, strict=True):
        n = len(completion.tokens)
        assert prefill.logits.shape[0] == n and prefill.hidden.shape == completion.hidden.shape  # type: ignore[union-attr]
        recomputed = token_logprobs(prefill.logits, torch.tensor(completion.tokens), 0.8)
        assert torch.allclose(recomputed, torch.tensor(completion.logprobs), atol=1e-4)
        assert torch.allclose(prefill.hidden, completion.hidden, atol=1e-4)  # type: ignore[arg-type]
        margin = replay_margin(prefill.logits, [seed] * n, list(range(n)), 0.8, completion.tokens)
        assert float(margin.max()) < 1e-4


def test_greedy_ignores_seeds_and_weights_can_be_swapped(engine: TorchEngine, tiny_model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    a = engine.generate(PROMPTS, [1, 2, 3], params)
    b = engine.generate(PROMPTS, [4, 5, 6], params)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.load_weights({k: torch.zeros_like(v) for k, v in original.items()}, policy_step=3)
    assert engine.policy_step == 3
    engine.load_weights(original, policy_step=0)
    assert [c.tokens for c in engine.generate(PROMPTS, [1, 2, 3], params)] == [c.tokens for c in a]


def test_bad_requests_are_refused(engine: TorchEngine) -> None:
    with pytest.raises(ValueError):
        engine.generate([[1, 2]], [1, 2], SamplingParams(4))
    with pytest.raises(ValueError):
        engine.generate([[]], [1], SamplingParams(4))
    with pytest.raises(ValueError):
        SamplingParams(0)
    assert engine.generate([], [], SamplingParams(3)) == []


def test_generation_passes_the_cache_under_the_name_this_transformers_takes(engine: TorchEngine) -> None:
    """transformers 5.x renamed ``past_key_values`` to ``cache``: the old name warned on every start
    (issue 36: noise that looks like failure) and goes away in 5.40."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning from the forward would fail here
        completions = engine.generate(PROMPTS, [1, 2, 3], SamplingParams(max_new_tokens=4))
    assert all(c.tokens for c in completions)
    parameters = inspect.signature(engine._decoder.forward).parameters
    assert cache_keyword(engine._decoder) in parameters


def test_the_cache_keyword_follows_the_forward_signature() -> None:
    class New:
        def forward(self, input_ids: object = None, cache: object = None) -> None: ...

    class Old:
        def forward(self, input_ids: object = None, past_key_values: object = None) -> None: ...

    assert cache_keyword(New()) == "cache"
    assert cache_keyword(Old()) == "past_key_values"
