"""Property tests of the pure TOPLOC math in crypto.toploc (no torch)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from crypto import toploc, toploc_field, toploc_topk
from crypto.errors import CryptoError

P = toploc_field.FIELD_PRIME


def lagrange_oracle(xs: list[int], ys: list[int]) -> list[int]:
    """Slow, independent interpolation: Σ y_i Π_{j≠i} (x − x_j)/(x_i − x_j), in Python integers."""
    k = len(xs)
    result = [0] * k
    for i in range(k):
        numerator = [1]  # Π_{j≠i} (x − x_j), constant term first
        denominator = 1
        for j in range(k):
            if j == i:
                continue
            numerator = [(a - xs[j] * b) % P for a, b in zip([0, *numerator], [*numerator, 0], strict=True)]
            denominator = denominator * (xs[i] - xs[j]) % P
        scale = ys[i] * pow(denominator, P - 2, P) % P
        result = [(r + scale * n) % P for r, n in zip(result, numerator, strict=True)]
    return result


points = st.integers(1, 40).flatmap(
    lambda k: st.tuples(
        st.lists(st.integers(0, P - 1), min_size=k, max_size=k, unique=True),
        st.lists(st.integers(0, P - 1), min_size=k, max_size=k),
    )
)


@given(points)
def test_interpolation_passes_through_every_point_and_matches_lagrange(case: tuple[list[int], ...]) -> None:
    xs, ys = case
    coefficients = toploc_field.interpolate(np.array([xs]), np.array([ys]))
    assert coefficients.shape == (1, len(xs))
    assert toploc_field.evaluate(coefficients, np.array([xs])).tolist() == [ys]
    assert coefficients[0].tolist() == lagrange_oracle(xs, ys)


@given(st.integers(0, 2**32 - 1))
def test_batched_interpolation_of_full_chunks_passes_through_the_points(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = 3
    xs = np.stack([rng.choice(P, size=toploc.TOPK, replace=False) for _ in range(rows)])
    ys = rng.integers(0, P, size=(rows, toploc.TOPK))
    coefficients = toploc_field.interpolate(xs, ys)
    assert np.array_equal(toploc_field.evaluate(coefficients, xs), ys)
    # Each row is interpolated independently of the others in the batch.
    assert np.array_equal(toploc_field.interpolate(xs[1:2], ys[1:2]), coefficients[1:2])


def test_interpolation_refuses_repeated_x() -> None:
    with pytest.raises(CryptoError) as caught:
        toploc_field.interpolate(np.array([[5, 9, 5]]), np.array([[1, 2, 3]]))
    assert caught.value.reason == "duplicate_points"


@given(st.lists(st.integers(0, 2**31 - 1), min_size=2, max_size=128, unique=True))
def test_injective_modulus_is_the_largest_that_separates_the_indices(xs: list[int]) -> None:
    modulus = int(toploc_field.injective_moduli(np.array([xs]))[0])
    assert toploc_field.MIN_MODULUS <= modulus <= P
    assert len({x % modulus for x in xs}) == len(xs)
    for larger in range(modulus + 1, P + 1):
        assert len({x % larger for x in xs}) < len(xs)


@given(st.integers(toploc_field.MIN_MODULUS, P), st.lists(st.integers(0, P - 1), min_size=128, max_size=128))
def test_encode_decode_round_trip(modulus: int, coefficients: list[int]) -> None:
    [proof] = toploc.encode_proofs(np.array([modulus]), np.array([coefficients]))
    assert len(proof) == toploc.PROOF_BYTES == 258
    assert proof[:2] == modulus.to_bytes(2, "big")  # big-endian u16 modulus first, as the reference
    assert proof[2:4] == coefficients[0].to_bytes(2, "big")  # then c_0 (constant term) …
    decoded_modulus, decoded = toploc.decode_proof(proof)
    assert decoded_modulus == modulus
    assert decoded.tolist() == coefficients


# Golden vectors: SHA-256 of `toploc` 0.1.6 `ProofPoly.from_points_tensor(xs, ys).to_bytes()` for these
# points (produced with the reference package by tests/verification/crosscheck_toploc_reference.py's
# method; the project does not depend on it). Seed 11 forces a modulus below 65497.
REFERENCE_PROOFS = [
    (0, 2048, 65497, "73b5649117478f16ba11c0fe4abce5f0cab2aa5572bec4b55ec962b4b15c3caf"),
    (1, 65497, 65497, "25b96a6b3e68e801966c45403fa7cb41e6947f3699e93129512b686d6b613be0"),
    (2, 131072, 65497, "62b5bac64ebf95351eb83ab0f1162f5c5b131a54a082ab4abb27cdf78deace9e"),
    (3, 2_000_000, 65497, "d0f9f27c6f16d2062c82d7771b6d617b2a8b182cce8277d0487b6a8f1b1fe6eb"),
    (11, 2_000_000, 65496, "e9b49ab96e05d6fac1a506130a9ddc467bbb2ad816838298f065d98319bf47eb"),
]


@pytest.mark.parametrize(("seed", "span", "modulus", "digest"), REFERENCE_PROOFS)
def test_proof_bytes_equal_the_reference(seed: int, span: int, modulus: int, digest: str) -> None:
    rng = np.random.default_rng(seed)
    xs = rng.choice(span, size=128, replace=False).astype(np.int64)[None, :]
    ys = rng.integers(0, 1 << 16, size=128).astype(np.int64)[None, :]
    moduli = toploc_field.injective_moduli(xs)
    [proof] = toploc.encode_proofs(moduli, toploc_field.interpolate(xs % moduli[:, None], ys))
    assert int(moduli[0]) == modulus
    assert hashlib.sha256(proof).hexdigest() == digest


# bf16 bit patterns of finite values (exponent field below 0xFF), either sign.
finite_bf16 = st.integers(0, 0x7F7F).flatmap(lambda m: st.sampled_from([m, m | 0x8000]))


def chunk_of(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint16)


@given(st.lists(finite_bf16, min_size=1, max_size=600))
def test_honest_chunk_checks_exactly(values: list[int]) -> None:
    chunk = chunk_of(values)
    [proof] = toploc.commit_chunks([chunk])
    assert len(proof) == 258  # also for chunks shorter than 128 entries (padded commitment)
    [check] = toploc.check_chunks([chunk], [proof])
    assert check == toploc.ChunkCheck(0, 0.0, 0.0, min(len(values), toploc.TOPK))


@given(st.lists(finite_bf16, min_size=128, max_size=600), st.data())
def test_any_single_changed_coefficient_is_rejected(values: list[int], data: st.DataObject) -> None:
    chunk = chunk_of(values)
    [proof] = toploc.commit_chunks([chunk])
    position = data.draw(st.integers(0, toploc.TOPK - 1))
    word = int.from_bytes(proof[2 + 2 * position : 4 + 2 * position], "big")
    forged_word = data.draw(st.integers(0, P - 1).filter(lambda w: w != word))
    forged = proof[: 2 + 2 * position] + forged_word.to_bytes(2, "big") + proof[4 + 2 * position :]
    [check] = toploc.check_chunks([chunk], [forged])
    # δ·x^i vanishes at x = 0 only, so at most one of the 128 evaluations keeps its value.
    assert check.exp_mismatches > 0 or check.mant_err_mean > 0
    assert toploc.REFERENCE_THRESHOLDS.failure(check) is not None


@given(st.lists(st.integers(0x0080, 0x7E7F), min_size=256, max_size=600), st.data())
def test_any_single_changed_exponent_or_mantissa_is_seen(values: list[int], data: st.DataObject) -> None:
    chunk = chunk_of(values)
    [proof] = toploc.commit_chunks([chunk])
    chosen = toploc_topk.top_entries(chunk[None, :], toploc.TOPK)[0]
    target = int(data.draw(st.sampled_from(chosen.tolist())))
    recomputed = chunk.copy()
    if data.draw(st.booleans()):
        recomputed[target] += 0x0080  # exponent + 1: larger, so it stays in the top-k set
        [check] = toploc.check_chunks([recomputed], [proof])
        assert check.exp_mismatches == 1
    else:
        mantissa = int(recomputed[target]) & 0x7F
        assume(mantissa < 0x7F)
        recomputed[target] += 1  # next mantissa: larger, stays in the top-k, exponent unchanged
        [check] = toploc.check_chunks([recomputed], [proof])
        assert check.exp_mismatches == 0 and check.mant_err_mean == pytest.approx(1 / toploc.TOPK)


def test_top_entries_break_ties_by_lower_index_and_ignore_sign() -> None:
    bits = np.full((1, 300), 0x3F80, dtype=np.uint16)  # 1.0 everywhere
    bits[0, 250] = 0xC000  # -2.0: the largest magnitude
    chosen = toploc_topk.top_entries(bits, 128)[0].tolist()
    assert chosen == [250, *range(127)]


@given(st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=300), st.data())
def test_top_entries_match_a_sorting_oracle(values: list[int], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(values)))
    chosen = toploc_topk.top_entries(np.array([values], dtype=np.uint16), k)[0].tolist()
    oracle = sorted(range(len(values)), key=lambda i: (-(values[i] & 0x7FFF), i))[:k]
    assert chosen == oracle


def test_compare_uses_the_upper_median_and_infinity_without_matching_exponents() -> None:
    own = np.array([0x3F80, 0x3F80, 0x3F80, 0x3F80])  # 1.0 (exponent 127, mantissa 0)
    claimed = np.array([0x3F81, 0x3F83, 0x3F80, 0x4000])  # mantissa errors 1, 3, 0; one exponent off
    check = toploc.compare_bits(claimed, own)
    assert (check.exp_mismatches, check.mant_err_mean, check.mant_err_median) == (1, 4 / 3, 1.0)
    nothing = toploc.compare_bits(np.array([0x4000, 0x4000]), np.array([0x3F80, 0x3F80]))
    assert nothing.exp_mismatches == 2 and math.isinf(nothing.mant_err_mean)
    assert toploc.REFERENCE_THRESHOLDS.failure(nothing) is not None


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "proof_truncated"),
        (b"\xff\xd9" + b"\x00" * 255, "proof_truncated"),
        (b"\xff\xd9" + b"\x00" * 257, "proof_too_long"),
        (b"\x00\x00" + b"\x00" * 256, "proof_modulus"),
        (b"\x80\x00" + b"\x00" * 256, "proof_modulus"),
        (b"\xff\xda" + b"\x00" * 256, "proof_modulus"),
        (b"\xff\xd9" + b"\xff\xd9" + b"\x00" * 254, "proof_coefficient"),
    ],
)
def test_malformed_proofs_are_crypto_errors_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(CryptoError) as caught:
        toploc.decode_proof(data)
    assert caught.value.reason == reason


def test_a_non_bytes_proof_is_a_crypto_error() -> None:
    with pytest.raises(CryptoError) as caught:
        toploc.decode_proof("not bytes")  # type: ignore[arg-type]
    assert caught.value.reason == "proof_type"


@given(st.binary(max_size=600), st.integers(0, 100))
def test_arbitrary_proof_bytes_either_check_or_raise_crypto_error(blob: bytes, n_tokens: int) -> None:
    chunks = [np.full(32 * 4, 0x3F80, dtype=np.uint16)] * -(-n_tokens // 32)
    try:
        proofs = toploc.split_proofs(blob, n_tokens)
        checks = toploc.check_chunks(chunks, proofs)
    except CryptoError as error:
        assert error.reason in {"proof_truncated", "proof_too_long", "proof_modulus", "proof_coefficient"}
    else:
        assert len(checks) == len(chunks)


def test_split_proofs_counts_started_chunks() -> None:
    assert toploc.split_proofs(b"", 0) == []
    assert len(toploc.split_proofs(bytes(258 * 2), 33)) == 2
    with pytest.raises(CryptoError) as caught:
        toploc.split_proofs(bytes(258), 33)
    assert caught.value.reason == "proof_truncated"
    assert toploc.chunk_entries(70, 64) == [2048, 2048, 384]


def test_check_refuses_a_proof_count_that_does_not_match() -> None:
    chunk = np.full(256, 0x3F80, dtype=np.uint16)
    with pytest.raises(CryptoError) as caught:
        toploc.check_chunks([chunk, chunk], toploc.commit_chunks([chunk]))
    assert caught.value.reason == "proof_count"


# --- Byte-identical to the implementation before the issue-11 speed-up (tests/verification/toploc_legacy.py)

from tests.verification import toploc_legacy as legacy  # noqa: E402


def wide_chunk(rng: np.random.Generator, width: int, kind: int) -> np.ndarray:
    """bf16 bits of one chunk: random words, heavy ties, Gaussian-like, or a few large channels."""
    if kind == 0:
        return rng.integers(0, 1 << 16, width).astype(np.uint16)
    if kind == 1:
        return (0x3F80 + rng.integers(0, 3, width)).astype(np.uint16)
    values = rng.standard_normal(width).astype(np.float32)
    if kind == 3:
        values[rng.integers(0, width, 40)] *= 500.0
    return (values.view(np.uint32) >> 16).astype(np.uint16)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.lists(
        st.sampled_from([1, 5, 64, 127, 128, 129, 300, 2048, 4095, 4096, 6000, 40_000]),
        min_size=1,
        max_size=8,
    ),
)
def test_commit_and_check_match_the_previous_implementation(seed: int, widths: list[int]) -> None:
    rng = np.random.default_rng(seed)
    chunks = [wide_chunk(rng, width, int(rng.integers(0, 4))) for width in widths]
    proofs = toploc.commit_chunks(chunks)
    assert proofs == legacy.commit_chunks(chunks)
    other = [wide_chunk(rng, len(chunk), 2) for chunk in chunks]  # a dishonest recomputation too
    for recomputed in (chunks, other):
        new = [vars(check) for check in toploc.check_chunks(recomputed, proofs)]
        old = [vars(check) for check in legacy.check_chunks(recomputed, proofs)]
        assert new == old


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(4096, 20_000), st.integers(1, 128))
def test_prefiltered_top_entries_match_the_exact_selection(seed: int, width: int, k: int) -> None:
    rng = np.random.default_rng(seed)
    bits = np.stack([wide_chunk(rng, width, kind) for kind in range(4)])
    assert np.array_equal(toploc_topk.top_entries(bits, k), legacy.top_entries(bits, k))


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 40))
def test_interpolation_matches_the_previous_implementation(seed: int, rows: int) -> None:
    rng = np.random.default_rng(seed)
    # Half the rows on the points {0, …, 127} (the precomputed-basis path), half anywhere in the field.
    xs = np.stack(
        [rng.permutation(128) if i % 2 else rng.choice(P, size=128, replace=False) for i in range(rows)]
    )
    ys = rng.integers(0, 1 << 16, size=(rows, 128))
    assert np.array_equal(toploc_field.interpolate(xs, ys), legacy.interpolate(xs, ys))


@given(st.lists(st.integers(0, 0xFFFFFFFF), min_size=1, max_size=200))
def test_bf16_rounding_is_round_to_nearest_even_with_one_nan(words: list[int]) -> None:
    values = np.array(words, dtype=np.uint32).view(np.float32)
    got = toploc_topk.bf16_round(values).tolist()
    for word, bits in zip(words, got, strict=True):
        if (word & 0x7FFFFFFF) > 0x7F800000:
            assert bits == 0x7FC0
        else:
            assert bits == ((word + 0x7FFF + ((word >> 16) & 1)) >> 16) & 0xFFFF
