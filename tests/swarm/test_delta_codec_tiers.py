"""Format version 2 of the delta codec: tiered chunks (exponent ranges, ranks among their members), no
sorted visiting order, version-1 deltas still read, every field of a tiered record refused when hostile."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from prime_node.swarm import delta_codec, delta_encode, delta_order
from prime_node.swarm.delta_format import (
    CHUNK_TIERED,
    FILE_TENSORS,
    MAGIC,
    MAX_TIERS,
    MIN_CHUNK_BYTES,
    TIER_DENSE,
    TIER_RANKED,
    VERSION,
    DeltaError,
    Tensor,
)
from prime_node.swarm.delta_order import exponents, ranks_in, tier_mask
from tests.swarm.test_delta_codec import _entry, _f32_change, _files, _frame, _safetensors

BASE = np.array([0.0, 0.0, 8.0, 0.0], dtype=np.float32)  # exponents 0, 0, 130, 0


def _delta(*entries: bytes, version: int = VERSION) -> bytes:
    body = MAGIC + struct.pack("<HII", version, MIN_CHUNK_BYTES, len(entries)) + b"".join(entries)
    return body + blake3(body).digest()


def _planes(values: list[int], width: int) -> bytes:
    return np.array(values, dtype=f"<u{width}").view(np.uint8).reshape(-1, width).T.tobytes()


def _tiered_entry(
    tiers: list[tuple[int, int, int, int]],
    rest: tuple[int, int],
    frames: list[bytes],
    target: np.ndarray,
    tier_count: int | None = None,
) -> bytes:
    """A tensors entry for a file like BASE's with one tiered chunk; the digest is of ``target``'s file."""
    header, _ = _safetensors(BASE)
    body = struct.pack("<Q", len(header)) + _frame(header)
    body += struct.pack("<BB", CHUNK_TIERED, len(tiers) if tier_count is None else tier_count)
    body += b"".join(struct.pack("<HBBI", *tier) for tier in tiers) + struct.pack("<BI", *rest)
    body += b"".join(frames)
    whole = _safetensors(target)[1]
    return _entry(b"model.safetensors", len(whole), FILE_TENSORS, body, whole)


def _valid() -> dict[str, Any]:
    """One ranked tier (exponents below 1: elements 0, 1, 3) changing its second member to 1.0, and the
    rest changing element 2 (exponent 130) from 8.0 to 9.0."""
    return {
        "tiers": [(1, TIER_RANKED, 1, 1)],
        "rest": (1, 1),
        "frames": [
            _frame(_planes([1], 1) + _planes([_f32_change(0.0, 1.0)], 4)),
            _frame(_planes([2], 1) + _planes([_f32_change(8.0, 9.0)], 4)),
        ],
        "target": np.array([0.0, 1.0, 9.0, 0.0], dtype=np.float32),
    }


@pytest.fixture
def base(tmp_path: Path) -> Path:
    directory = tmp_path / "base"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(_safetensors(BASE)[1])
    return directory


def test_a_hand_built_tiered_delta_applies(base: Path, tmp_path: Path) -> None:
    (tmp_path / "d").write_bytes(_delta(_tiered_entry(**_valid())))
    delta_codec.apply_delta(base, tmp_path / "d", tmp_path / "out", max_output_bytes=1 << 20)
    assert _files(tmp_path / "out") == {"model.safetensors": _safetensors(_valid()["target"])[1]}


def _with(**changes: Any) -> bytes:
    return _delta(_tiered_entry(**(_valid() | changes)))


HOSTILE = {
    "bounds not increasing": (
        _with(tiers=[(1, TIER_RANKED, 1, 1), (1, TIER_RANKED, 1, 1)]),
        "tier bound",
    ),
    "bound past the exponents": (_with(tiers=[(257, TIER_RANKED, 1, 1)]), "tier bound"),
    "bound zero": (_with(tiers=[(0, TIER_RANKED, 1, 1)]), "tier bound"),
    "unknown mode": (_with(tiers=[(1, 7, 1, 1)]), "tier of mode"),
    "dense tier with gaps": (_with(tiers=[(1, TIER_DENSE, 1, 3)]), "tier of mode"),
    "ranked gap width": (_with(tiers=[(1, TIER_RANKED, 3, 1)]), "tier of mode"),
    "rest gap width": (_with(rest=(5, 1)), "rest has gaps"),
    "too many tiers": (_with(tier_count=MAX_TIERS + 1), "tiers"),
    "payload past the chunk": (_with(rest=(8, 2)), "tiered chunk of"),
    "dense count unlike the base": (
        _with(tiers=[(1, TIER_DENSE, 0, 2)], frames=[_frame(b"\0" * 8), _valid()["frames"][1]]),
        "dense tier of 2",
    ),
    "rank past the tier": (
        _with(frames=[_frame(_planes([3], 1) + _planes([2], 4)), _valid()["frames"][1]]),
        "positions are out of range",
    ),
    "rest past the chunk": (
        _with(frames=[_valid()["frames"][0], _frame(_planes([4], 1) + _planes([2], 4))]),
        "positions are out of range",
    ),
    "frame of another size": (
        _with(frames=[_frame(b"\0" * 6), _valid()["frames"][1]]),
        "declares",
    ),
    "tiered chunk in a version-1 delta": (
        _delta(_tiered_entry(**_valid()), version=1),
        "unknown chunk kind 4",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_tiered_records_are_refused(base: Path, tmp_path: Path, case: str) -> None:
    delta, reason = HOSTILE[case]
    (tmp_path / "d").write_bytes(delta)
    with pytest.raises(DeltaError, match=reason):
        delta_codec.apply_delta(base, tmp_path / "d", tmp_path / "out", max_output_bytes=1 << 20)
    assert not (tmp_path / "out").exists()


def test_a_version_1_delta_still_applies(base: Path, tmp_path: Path) -> None:
    """Version 1's sparse record (exponent-sorted order) under a version-1 header."""
    header, _ = _safetensors(BASE)
    body = struct.pack("<Q", len(header)) + _frame(header)
    # visiting order: the three zeros (0, 1, 3), then 8.0 (2): the fourth visited, gap 3, is element 2
    body += struct.pack("<BBI", 1, 1, 1) + _frame(_planes([3], 1) + _planes([_f32_change(8.0, 9.0)], 4))
    whole = _safetensors(np.array([0.0, 0.0, 9.0, 0.0], dtype=np.float32))[1]
    delta = _delta(_entry(b"model.safetensors", len(whole), FILE_TENSORS, body, whole), version=1)
    (tmp_path / "d").write_bytes(delta)
    delta_codec.apply_delta(base, tmp_path / "d", tmp_path / "out", max_output_bytes=1 << 20)
    assert _files(tmp_path / "out") == {"model.safetensors": whole}


def _optimizer_step(weights: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """float32 masters moved by a uniform ±lr (about what AdamW does) and published rounded to bf16."""
    generator = torch.Generator().manual_seed(seed)
    moved = {name: (torch.rand(t.shape, generator=generator) * 2 - 1) * lr for name, t in weights.items()}
    return {name: (tensor.float() + moved[name]).to(torch.bfloat16) for name, tensor in weights.items()}


def test_an_optimizer_step_is_coded_in_tiers_and_never_sorted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 values moved like an AdamW step round-trip through tiered chunks, small, and neither side
    computes version 1's sorted visiting order (the sort that dominated its time)."""
    from prime_node.ml.architectures import write_model_dir

    def sorted_order(*args: object) -> None:
        raise AssertionError("the version-1 visiting order was computed")

    monkeypatch.setattr(delta_order, "visit", sorted_order)
    monkeypatch.setattr(delta_order, "visit_order", sorted_order)
    kinds: list[int] = []
    encode_chunk = delta_encode.encode_chunk

    def spy(*args: Any) -> tuple[bytes, int]:
        record, changed = encode_chunk(*args)
        kinds.append(record[0])
        return record, changed

    monkeypatch.setattr(delta_encode, "encode_chunk", spy)
    base = write_model_dir("qwen3", "tiny", 0, tmp_path / "base", dtype="bfloat16")
    target = tmp_path / "target"
    shutil.copytree(base, target)
    weights = load_file(str(base / "model.safetensors"))
    save_file(_optimizer_step(weights, 1e-5, 0), str(target / "model.safetensors"), metadata={"format": "pt"})
    delta = tmp_path / "weights.delta"
    stats = delta_codec.encode_delta(base, target, delta, chunk_bytes=MIN_CHUNK_BYTES)
    delta_codec.apply_delta(base, delta, tmp_path / "out", max_output_bytes=stats.full_bytes)
    assert _files(tmp_path / "out") == _files(target)
    data = delta.read_bytes()
    assert struct.unpack_from("<H", data, len(MAGIC))[0] == VERSION == 2
    assert CHUNK_TIERED in kinds
    assert 0 < stats.changed_values < 0.5 * stats.total_values
    assert stats.delta_bytes < 0.1 * stats.full_bytes


_FLOATS = [("BF16", 2), ("F16", 2), ("F32", 4), ("F64", 8), ("F8_E4M3", 1), ("F8_E5M2", 1), ("I32", 4)]


@settings(max_examples=80, deadline=None)
@given(
    kind=st.sampled_from(_FLOATS),
    data=st.binary(min_size=8, max_size=4096),
    bounds=st.tuples(st.integers(0, 2048), st.integers(0, 2048)),
    flag_seed=st.integers(0, 2**32 - 1),
)
def test_tier_masks_and_ranks_match_their_definition(
    kind: tuple[str, int], data: bytes, bounds: tuple[int, int], flag_seed: int
) -> None:
    """A tier is the elements whose exponent field is in [low, high); a rank counts the tier's members
    before an element; both from their definitions, for every float width and an integer dtype."""
    dtype, width = kind
    count = len(data) // width
    bits = np.frombuffer(data[: count * width], dtype=f"<u{width}")
    tensor = Tensor("t", dtype, 0, count * width, width)
    top = 1 << tensor.exponent_bits
    low, high = sorted(min(b, top) for b in bounds)
    floating = tensor.floating
    expected = (bits >> tensor.mantissa_bits) & (top - 1) if floating else np.zeros(count, dtype=np.uint64)
    assert np.array_equal(exponents(bits, tensor), expected)
    mask = tier_mask(exponents(bits, tensor), low, high, tensor)
    inside = (expected >= low) & (expected < high)
    assert np.array_equal(np.ones(count, dtype=bool) if mask is None else mask, inside)
    where = np.flatnonzero(inside & (np.random.default_rng(flag_seed).random(count) < 0.4))
    ranks = ranks_in(inside, where)
    assert np.array_equal(ranks, np.searchsorted(np.flatnonzero(inside), where))
