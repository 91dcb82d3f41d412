"""TOPLOC proofs on real forward passes of tiny Qwen2-style models through our torch engine."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from crypto.errors import CryptoError  # noqa: E402
from crypto.toploc import REFERENCE_THRESHOLDS  # noqa: E402
from prime_node.ml.engine import SamplingParams, TorchEngine  # noqa: E402
from prime_node.ml.engines import engine_spec  # noqa: E402
from prime_node.ml.model import create_tiny_model  # noqa: E402
from prime_node.verification.proofs import build_proofs, check_proofs, proof_failure  # noqa: E402

ENGINE_THRESHOLDS = engine_spec("torch").toploc_thresholds()  # the engine these tests run

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
    assert all(proof_failure(per, ENGINE_THRESHOLDS) is None for per in checks)
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
        assert proof_failure(checks, ENGINE_THRESHOLDS) is not None


def test_a_cut_proof_is_a_crypto_error(honest: Honest) -> None:
    validator_engine, completions, proofs = honest
    prefills = validator_engine.prefill(PROMPTS[:1], [completions[0].tokens])
    with pytest.raises(CryptoError) as caught:
        check_proofs([prefills[0].hidden], [proofs[0][:-1]])
    assert caught.value.reason == "proof_truncated"


def test_proofs_match_the_previous_implementation_on_float_hidden_states() -> None:
    """Same bytes and checks as before the speed-up (which rounded whole matrices with torch), for
    float32 (rounded lazily in numpy), bfloat16 and float16 inputs, at small and 4096-wide hidden sizes."""
    import numpy as np
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tests.verification import toploc_legacy as legacy

    @settings(max_examples=12, deadline=None)
    @given(st.integers(0, 2**32 - 1))
    def compare(seed: int) -> None:
        rng = np.random.default_rng(seed)
        hidden_size = int(rng.choice([8, 64, 4096]))
        hiddens = []
        for _ in range(int(rng.integers(1, 5))):
            tokens = int(rng.integers(0, 70 if hidden_size < 4096 else 40))
            values = rng.standard_normal((tokens, hidden_size)).astype(np.float32)
            if rng.integers(0, 2):  # halfway cases of the bf16 rounding, and ties
                words = values.view(np.uint32)
                words[:] = (words & 0xFFFF0000) | rng.choice([0x8000, 0x7FFF, 0x8001, 0], size=words.shape)
            if tokens and rng.integers(0, 2):
                values[:, 3] *= 400.0  # a massive-activation channel
            hiddens.append(torch.from_numpy(values))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            cast = [h.to(dtype) for h in hiddens]
            proofs = build_proofs(cast)
            assert proofs == legacy.build_proofs(cast)
            new = [[vars(c) for c in per] for per in check_proofs(cast, proofs)]
            assert new == [[vars(c) for c in per] for per in legacy.check_proofs(cast, proofs)]

    compare()


def test_numpy_bf16_rounding_equals_torch_for_every_non_nan_value() -> None:
    import numpy as np

    from crypto.toploc_topk import bf16_round

    rng = np.random.default_rng(0)
    words = np.concatenate(
        [
            rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32),
            (rng.integers(0, 1 << 16, 20_000, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000,
            np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 1], dtype=np.uint32),
        ]
    )
    words = words[(words & 0x7FFFFFFF) <= 0x7F800000]
    values = words.view(np.float32)
    expected = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bf16_round(values), expected)


def test_points_chosen_on_the_device_equal_the_numpy_selection() -> None:
    """``device_points`` (top-k with torch where the hidden states live, GPU hidden states take it) picks
    exactly the points of the numpy path: float32 with rounding halfway cases and NaN, bfloat16, float16,
    hidden sizes below and above k per chunk, short last chunks, empty completions. Run here on CPU
    tensors; the operations are the same on CUDA."""
    import numpy as np
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from crypto import toploc, toploc_topk
    from prime_node.verification.proofs import _chunk_blocks, device_points

    @settings(max_examples=25, deadline=None)
    @given(st.integers(0, 2**32 - 1))
    def compare(seed: int) -> None:
        rng = np.random.default_rng(seed)
        hidden_size = int(rng.choice([1, 3, 8, 64, 1024]))
        hiddens = []
        for _ in range(int(rng.integers(1, 4))):
            values = rng.standard_normal((int(rng.integers(0, 70)), hidden_size)).astype(np.float32)
            if rng.integers(0, 2):  # halfway cases of the bf16 rounding, and magnitude ties
                words = values.view(np.uint32)
                words[:] = (words & 0xFFFF0000) | rng.choice([0x8000, 0x7FFF, 0x8001, 0], size=words.shape)
            if values.size and rng.integers(0, 3) == 0:
                values.reshape(-1)[rng.integers(0, values.size, 3)] = np.nan
            hiddens.append(torch.from_numpy(values))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            cast = [h.to(dtype) for h in hiddens]
            expected = toploc_topk.select_points(_chunk_blocks(cast)[0], toploc.TOPK)
            got = device_points(cast)
            assert np.array_equal(got.xs, expected.xs)
            assert np.array_equal(got.ys, expected.ys)
            assert np.array_equal(got.counts, expected.counts)

    compare()
