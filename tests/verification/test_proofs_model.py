"""TOPLOC proofs on real forward passes of tiny Qwen2-style models through our torch engine."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from crypto.errors import CryptoError  # noqa: E402
from crypto.toploc import REFERENCE_THRESHOLDS  # noqa: E402
from prime_node.ml.engine import SamplingParams, TorchEngine  # noqa: E402
from prime_node.ml.model import create_tiny_model  # noqa: E402
from prime_node.verification.proofs import (  # noqa: E402
    ENGINE_THRESHOLDS,
    build_proofs,
    check_proofs,
    proof_failure,
)

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17], [18, 19, 20]]
SEEDS = [101, 202, 303, 404, 505]
PARAMS = SamplingParams(max_new_tokens=70, temperature=1.0, return_hidden=True)


def engine(seed: int) -> TorchEngine:
    model, tokenizer = create_tiny_model(seed)
    return TorchEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def honest() -> tuple[TorchEngine, list[Any], list[bytes]]:
    validator_engine = engine(0)
    completions = validator_engine.generate(PROMPTS, SEEDS, PARAMS)
    proofs = build_proofs([c.hidden for c in completions if c.hidden is not None])
    return validator_engine, completions, proofs


Honest = tuple[TorchEngine, list[Any], list[bytes]]


def test_honest_generation_verifies_by_one_prefill(honest: Honest) -> None:
    validator_engine, completions, proofs = honest
    assert [len(p) for p in proofs] == [258 * -(-len(c.tokens) // 32) for c in completions]
    prefills = validator_engine.prefill(PROMPTS, [c.tokens for c in completions])
    checks = check_proofs([p.hidden for p in prefills], proofs)
    assert all(proof_failure(per) is None for per in checks)
    # KV-cache generation and a prefill round float32 differently (~1e-6 relative), which moves a bf16
    # value only when it sits on a rounding boundary: at most a stray mantissa step.
    assert all(c.exp_mismatches <= 1 and c.mant_err_median == 0 for per in checks for c in per)


def test_a_model_with_another_seed_is_rejected(honest: Honest) -> None:
    validator_engine, _, _ = honest
    cheater = engine(1).generate(PROMPTS, SEEDS, PARAMS)
    proofs = build_proofs([c.hidden for c in cheater if c.hidden is not None])
    prefills = validator_engine.prefill(PROMPTS, [c.tokens for c in cheater])
    checks = check_proofs([p.hidden for p in prefills], proofs)
    # Rejected even under the reference's loose cross-hardware bounds, and chunk by chunk.
    assert all(proof_failure(per, REFERENCE_THRESHOLDS) == "toploc_exponent_mismatch" for per in checks)
    assert all(ENGINE_THRESHOLDS.failure(c) is not None for per in checks for c in per)


def test_a_proof_for_other_completions_is_rejected(honest: Honest) -> None:
    validator_engine, completions, proofs = honest
    prefills = validator_engine.prefill(PROMPTS, [c.tokens for c in completions])
    # Every completion checked against another completion's proof of the same length class.
    by_length = sorted(range(len(proofs)), key=lambda i: len(proofs[i]))
    pairs = [(a, b) for a, b in itertools.pairwise(by_length) if len(proofs[a]) == len(proofs[b])]
    assert pairs, "need two completions with the same number of chunks"
    for a, b in pairs:
        [checks] = check_proofs([prefills[a].hidden], [proofs[b]])
        assert proof_failure(checks) is not None


def test_a_cut_proof_is_a_crypto_error(honest: Honest) -> None:
    validator_engine, completions, proofs = honest
    prefills = validator_engine.prefill(PROMPTS[:1], [completions[0].tokens])
    with pytest.raises(CryptoError) as caught:
        check_proofs([prefills[0].hidden], [proofs[0][:-1]])
    assert caught.value.reason == "proof_truncated"
