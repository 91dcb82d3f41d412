"""The compiled kernels (prime_node/swarm/delta_kernels.py) against the numpy reference: the same records,
the same rebuilt chunks and the same refusals, for every element size the codec handles, edge values
included, and deltas of either path applied by the other."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from prime_node.swarm import delta_codec, delta_encode, delta_select
from prime_node.swarm.delta_apply import Decompressors, _apply_chunk, _Part, _Record
from prime_node.swarm.delta_format import (
    CHUNK_RAW,
    CHUNK_TIERED,
    GAP_WIDTHS,
    MIN_CHUNK_BYTES,
    TIER_DENSE,
    TIER_RANKED,
    UINT,
    DeltaError,
    Tensor,
)
from prime_node.swarm.delta_order import exponents

KERNELS = delta_select.kernels() or pytest.importorskip("prime_node.swarm.delta_kernels")
# dtype, element size: every float width, integers, and a dtype the codec does not know (coded per byte)
DTYPES = [
    ("BF16", 2),
    ("F16", 2),
    ("F32", 4),
    ("F64", 8),
    ("F8_E4M3", 1),
    ("F8_E5M2", 1),
    ("I16", 2),
    ("I32", 4),
    ("I64", 8),
    ("U8", 1),
    ("Q4_SOMETHING", 1),
]
_COMPRESSOR = zstandard.ZstdCompressor(level=1, write_content_size=True)


def _compress(data: Any) -> bytes:
    compressed = _COMPRESSOR.compress(data)
    return struct.pack("<I", len(compressed)) + compressed


@contextmanager
def _path(kernels: ModuleType | None) -> Iterator[None]:
    """Code chunks with ``kernels`` (None: numpy) inside the block."""
    with mock.patch.object(delta_select, "kernels", lambda: kernels):
        yield


def _edge_values(tensor: Tensor) -> list[int]:
    """Bit patterns of ±0, ±inf, NaNs, the smallest and largest subnormal and finite values (floats), or
    0, 1 and the extremes (anything else)."""
    bits = 8 * tensor.element_size
    top = (1 << bits) - 1
    if not tensor.floating:
        return [0, 1, top, top >> 1, 1 << (bits - 1)]
    sign, mantissa = 1 << (bits - 1), tensor.mantissa_bits
    inf = ((1 << tensor.exponent_bits) - 1) << mantissa
    patterns = [
        0,
        1,
        (1 << mantissa) - 1,
        1 << mantissa,
        inf - 1,
        inf,
        inf | 1,
        inf | (1 << (mantissa - 1)),
        top,
    ]
    return patterns + [pattern | sign for pattern in patterns]


def _chunk_pair(
    tensor: Tensor, count: int, share: float, style: str, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """A base chunk (weights around 0.02, sprinkled with edge values) and a target with ``share`` of its
    elements changed: by a few representable steps (as an optimizer step does) or to random bits."""
    rng = np.random.default_rng(seed)
    kind = UINT[tensor.element_size]
    if tensor.floating and tensor.element_size >= 2:
        floats = rng.standard_normal(count) * 0.02
        as_float = {"BF16": np.float32, "F16": np.float16, "F32": np.float32, "F64": np.float64}[tensor.dtype]
        old = floats.astype(as_float).view(UINT[np.dtype(as_float).itemsize])
        old = (old >> 16).astype(kind) if tensor.dtype == "BF16" else old.astype(kind)
    else:
        old = rng.integers(0, 1 << (8 * tensor.element_size), count, dtype=kind, endpoint=False)
    edges = np.array(_edge_values(tensor), dtype=kind)
    spots = rng.random(count) < 0.05
    old[spots] = rng.choice(edges, int(spots.sum()))
    moved = rng.random(count) < share
    if style == "steps":
        step = rng.integers(-3, 4, count).astype(np.int64)
        new = (old.astype(np.int64) + step).astype(kind)  # wraps around at the extremes
    else:
        new = rng.integers(0, 1 << (8 * tensor.element_size), count, dtype=kind, endpoint=False)
    return old, np.where(moved, new, old).astype(kind)


def _tensor(dtype: str, width: int, count: int) -> Tensor:
    return Tensor("t", dtype, 0, count * width, width)


def _plans(tensor: Tensor) -> st.SearchStrategy[list[tuple[int, int]]]:
    """Any tier plan the format allows: up to 8 increasing bounds within the exponents, any modes."""
    top = 1 << tensor.exponent_bits
    bounds = st.lists(st.integers(1, top), max_size=8, unique=True).map(sorted)
    return bounds.flatmap(
        lambda found: st.lists(
            st.sampled_from([TIER_DENSE, TIER_RANKED]), min_size=len(found), max_size=len(found)
        ).map(lambda modes: list(zip(found, modes, strict=True)))
    )


@st.composite
def chunks(draw: st.DrawFn, counts: list[int]) -> tuple[Tensor, np.ndarray, np.ndarray]:
    dtype, width = draw(st.sampled_from(DTYPES))
    count = draw(st.sampled_from(counts))
    share = draw(st.sampled_from([0.0, 1 / count, 0.01, 0.1, 0.5, 0.9, 1.0]))
    style = draw(st.sampled_from(["steps", "random"]))
    old, new = _chunk_pair(_tensor(dtype, width, count), count, share, style, draw(st.integers(0, 2**32 - 1)))
    return _tensor(dtype, width, count), old, new


def _flat(parts: delta_encode.Parts) -> list[tuple[int, int, bytes]]:
    return [(gaps, count, bytes(data)) for gaps, count, data in parts]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), chunk=chunks([1, 2, 7, 64, 1000, 3001]))
def test_every_tier_plan_codes_the_same_parts(
    data: st.DataObject, chunk: tuple[Tensor, np.ndarray, np.ndarray]
) -> None:
    """For any plan (not only those ``plan`` picks), the kernels' tiers, ranks, gaps and planes are
    numpy's, byte for byte, and so is the count of changed elements."""
    tensor, old, new = chunk
    tiers = data.draw(_plans(tensor) | st.just([(1 << tensor.exponent_bits, TIER_DENSE)]))
    expected, changed = delta_encode._parts(old, new, old != new, tiers, tensor)
    found, found_changed = delta_encode._compiled_parts(KERNELS, old, new, tiers, tensor)
    assert _flat(found) == _flat(expected)
    assert found_changed == changed


def _encode(
    kernels: ModuleType | None, base: bytes | None, target: bytes, tensor: Tensor
) -> tuple[bytes, int]:
    with _path(kernels):
        return delta_encode.encode_chunk(_compress, base, target, tensor)


def _record(record: bytes, tensor: Tensor) -> _Record:
    """A chunk record as delta_apply reads it (the reading itself is numpy-free and shared)."""
    from io import BytesIO

    from prime_node.swarm.delta_apply import Reader, _read_record

    reader = Reader(BytesIO(record))
    reader.version = 2
    return _read_record(reader, tensor, tensor.end - tensor.begin)


def _apply(kernels: ModuleType | None, record: _Record, base: bytes, tensor: Tensor) -> bytes | str:
    """The rebuilt chunk, or the refusal's message."""
    with _path(kernels):
        try:
            rebuilt = _apply_chunk(Decompressors(), record, lambda: base, tensor.end - tensor.begin, tensor)
        except DeltaError as exc:
            return str(exc)
    return rebuilt if isinstance(rebuilt, bytes) else rebuilt.tobytes()


@settings(max_examples=150, deadline=None)
@given(chunk=chunks([1, 3, 500, 4096, 1 << 16, (1 << 16) + 5]))
def test_chunks_encode_to_the_same_record_and_apply_either_way(
    chunk: tuple[Tensor, np.ndarray, np.ndarray],
) -> None:
    """Both paths pick the same record (plan from the sample, tiers, raw or not) for any chunk, and each
    path rebuilds the target from it; raw records (no base) too."""
    tensor, old, new = chunk
    base, target = old.tobytes(), new.tobytes()
    record, changed = _encode(KERNELS, base, target, tensor)
    assert (record, changed) == _encode(None, base, target, tensor)
    assert changed == int(np.count_nonzero(old != new))
    read = _record(record, tensor)
    assert _apply(KERNELS, read, base, tensor) == _apply(None, read, base, tensor) == target
    raw = _encode(KERNELS, None, target, tensor)
    assert raw == _encode(None, None, target, tensor) and raw[0][0] == CHUNK_RAW
    assert _apply(KERNELS, _record(raw[0], tensor), base, tensor) == target


@st.composite
def hostile_tiered(draw: st.DrawFn) -> tuple[Tensor, _Record, bytes]:
    """A tiered record that passes the reader's checks (bounds, modes, widths, sizes) with any counts
    and payload bytes: ranks and positions anywhere, increasing or not, overflowing or not."""
    dtype, width = draw(st.sampled_from(DTYPES))
    count = draw(st.sampled_from([1, 2, 5, 40, 300]))
    tensor = _tensor(dtype, width, count)
    base = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(
        0, 256, count * width, dtype=np.uint8
    )
    if tensor.floating and draw(st.booleans()):  # a base whose exponents fill the low tiers
        base = np.frombuffer(_chunk_pair(tensor, count, 0.0, "steps", 1)[0].tobytes(), dtype=np.uint8)
    tiers = draw(_plans(tensor))
    exponent = exponents(np.frombuffer(base.tobytes(), dtype=UINT[width]), tensor)
    parts = []
    budget = count * width
    low = 0
    for bound, mode in [*tiers, (1 << tensor.exponent_bits, None)]:
        gap_width = 0 if mode == TIER_DENSE else draw(st.sampled_from(GAP_WIDTHS))
        members = int(np.count_nonzero((exponent >= low) & (exponent < bound))) if mode is not None else count
        low = bound
        most = budget // (gap_width + width)
        honest = draw(st.booleans())  # keys that fit (gaps of 0 or 1, few enough), or any bytes
        values = draw(st.integers(0, min(most, members // 2) if honest else most))
        if mode == TIER_DENSE and honest and members <= most:
            values = members  # the count the base implies
        budget -= values * (gap_width + width)
        size = values * (gap_width + width)
        payload = draw(st.binary(min_size=size, max_size=size))
        if honest and gap_width:
            gaps = np.array(
                draw(st.lists(st.integers(0, 1), min_size=values, max_size=values)), dtype=f"<u{gap_width}"
            )
            payload = gaps.view(np.uint8).reshape(-1, gap_width).T.tobytes() + payload[values * gap_width :]
        parts.append(_Part(bound, mode, gap_width, values, _compress(payload)[4:] if values else b""))
    return tensor, _Record(CHUNK_TIERED, parts=tuple(parts)), base.tobytes()


@settings(max_examples=300, deadline=None)
@given(case=hostile_tiered())
def test_hostile_tiered_records_are_refused_alike(case: tuple[Tensor, _Record, bytes]) -> None:
    """Whatever a tiered record holds, the compiled kernel rebuilds exactly what numpy rebuilds, or refuses
    it with the same message (dense tiers of the wrong size, ranks or positions out of range, not
    increasing or wrapping around)."""
    tensor, record, base = case
    rebuilt = _apply(KERNELS, record, base, tensor)
    assert rebuilt == _apply(None, record, base, tensor)
    event("refused" if isinstance(rebuilt, str) else "rebuilt")


def test_a_rest_change_on_a_tier_member_applies_to_the_base_value() -> None:
    """A hostile record may code one element twice, in a ranked tier and in the rest: both paths apply
    the rest's change to the base value (numpy's last assignment wins)."""
    tensor = _tensor("F32", 4, 4)
    base = np.array([0.5, 0.25, 8.0, 0.75], dtype="<f4").tobytes()  # exponents 126, 125, 130, 126
    tier = _Part(127, TIER_RANKED, 1, 1, _compress(bytes([1]) + struct.pack("<I", 6))[4:])  # member 1
    rest = _Part(1 << 8, None, 1, 1, _compress(bytes([1]) + struct.pack("<I", 9))[4:])  # element 1
    record = _Record(CHUNK_TIERED, parts=(tier, rest))
    rebuilt = _apply(KERNELS, record, base, tensor)
    assert rebuilt == _apply(None, record, base, tensor)
    assert isinstance(rebuilt, bytes) and rebuilt != base and rebuilt[4:8] != base[4:8]
    assert rebuilt[:4] == base[:4] and rebuilt[8:] == base[8:]


def test_wrapping_positions_are_refused_on_both_paths() -> None:
    """Gaps of 2^64 - 1 wrap a uint64 position back onto the one before: numpy's cumulative sum and the
    kernel's running key both wrap, and both refuse."""
    tensor = _tensor("F32", 4, 8)
    gaps = np.array([1, 2**64 - 1], dtype="<u8").view(np.uint8).reshape(-1, 8).T.tobytes()
    rest = _Part(1 << 8, None, 8, 2, _compress(gaps + bytes(8))[4:])
    record = _Record(CHUNK_TIERED, parts=(rest,))
    base = bytes(32)
    assert _apply(KERNELS, record, base, tensor) == _apply(None, record, base, tensor)
    assert "out of range" in str(_apply(KERNELS, record, base, tensor))


def test_wrapping_ranks_in_a_ranked_tier_are_refused_on_both_paths() -> None:
    """The same inside a ranked tier, whose keys index the members' positions the kernel listed: a key
    wrapped back below the one before (here to rank 0, a real member) is refused, never applied twice."""
    tensor = _tensor("F32", 4, 8)
    for last in (2**64 - 1, 2**64 - 2):  # back onto rank 1, and below it to rank 0
        gaps = np.array([1, last], dtype="<u8").view(np.uint8).reshape(-1, 8).T.tobytes()
        tier = _Part(1, TIER_RANKED, 8, 2, _compress(gaps + struct.pack("<II", 5, 7))[4:])
        record = _Record(CHUNK_TIERED, parts=(tier, _Part(1 << 8, None, 1, 0, b"")))
        base = bytes(32)  # every element of exponent 0: all eight are the tier's members
        assert _apply(KERNELS, record, base, tensor) == _apply(None, record, base, tensor)
        assert "out of range" in str(_apply(KERNELS, record, base, tensor))


def _optimizer_step(weights: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (tensor.float() + (torch.rand(tensor.shape, generator=generator) * 2 - 1) * lr).to(tensor.dtype)
        for name, tensor in weights.items()
    }


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deltas_of_either_path_apply_on_the_other(tmp_path: Path, dtype: str) -> None:
    """A whole model's delta is the same file from both paths, and applies byte-identically crosswise."""
    from prime_node.ml.architectures import write_model_dir

    base = write_model_dir("qwen3", "tiny", 0, tmp_path / "base", dtype=dtype)
    target = tmp_path / "target"
    shutil.copytree(base, target)
    weights = load_file(str(base / "model.safetensors"))
    save_file(_optimizer_step(weights, 1e-4, 0), str(target / "model.safetensors"), metadata={"format": "pt"})
    deltas = {}
    for name, kernels in (("numba", KERNELS), ("numpy", None)):
        with _path(kernels):
            delta_codec.encode_delta(base, target, tmp_path / f"{name}.delta", chunk_bytes=MIN_CHUNK_BYTES)
        deltas[name] = (tmp_path / f"{name}.delta").read_bytes()
    assert deltas["numba"] == deltas["numpy"]
    for encoded, applier in (("numba", None), ("numpy", KERNELS)):
        out = tmp_path / f"{encoded}-out"
        with _path(applier):
            delta_codec.apply_delta(base, tmp_path / f"{encoded}.delta", out, max_output_bytes=1 << 30)
        for path in target.iterdir():
            assert (out / path.name).read_bytes() == path.read_bytes()


def test_the_path_is_chosen_once_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    delta_select.kernels.cache_clear()
    try:
        monkeypatch.setenv(delta_select.ENV, "numpy")
        assert delta_select.kernels() is None
        monkeypatch.setenv(delta_select.ENV, "numba")
        assert delta_select.kernels() is None  # chosen once per process
        delta_select.kernels.cache_clear()
        assert delta_select.kernels() is KERNELS
        monkeypatch.setitem(sys.modules, "numba", None)  # numba missing: numpy
        monkeypatch.delitem(sys.modules, "prime_node.swarm.delta_kernels")
        delta_select.kernels.cache_clear()
        assert delta_select.kernels() is None
    finally:
        delta_select.kernels.cache_clear()


_BOUNDS_CHECKED = """
import sys
sys.path.insert(0, {root!r})
from hypothesis import given, settings
from tests.swarm import test_delta_kernels as t

@settings(max_examples=150, deadline=None)
@given(case=t.hostile_tiered())
def walk(case):
    t._apply(t.KERNELS, case[1], case[2], case[0])

walk()
settings(max_examples=60, deadline=None)(given(chunk=t.chunks([1, 7, 1000]))(
    t.test_chunks_encode_to_the_same_record_and_apply_either_way.hypothesis.inner_test))()
print("ok")
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_kernels_stay_in_bounds_on_hostile_records(tmp_path: Path) -> None:
    """The kernels compiled with numba's bounds checks (every index checked, IndexError otherwise) code
    and walk random chunks and hostile records without one access out of bounds."""
    root = str(Path(__file__).resolve().parents[2])
    env = os.environ | {"NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    env.pop(delta_select.ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", _BOUNDS_CHECKED.format(root=root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1100,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


_SMALL_DELTA = """
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
from prime_node.swarm import delta_codec, delta_select
base, target, out = (Path(p) for p in sys.argv[1:4])
delta_codec.encode_delta(base, target, out / "d.delta")
delta_codec.apply_delta(base, out / "d.delta", out / "applied", max_output_bytes=1 << 30)
loaded_by_small = "numba" in sys.modules
delta_select.load_for(delta_select.COMPILED_FROM_BYTES)
print(loaded_by_small, "numba" in sys.modules, delta_select.current() is not None)
"""


@pytest.mark.parametrize(("asked", "expected"), [("", "False True True"), ("numba", "True True True")])
def test_a_small_models_deltas_do_not_load_the_compiled_kernels(
    tmp_path: Path, asked: str, expected: str
) -> None:
    """Loading numba costs a process ~0.8 CPU-s, more than a small model's deltas save: a small
    checkpoint is coded with numpy unless the kernels are asked for; a big file loads them."""
    from prime_node.ml.architectures import write_model_dir

    base = write_model_dir("qwen3", "tiny", 0, tmp_path / "base", dtype="float32")
    target = tmp_path / "target"
    shutil.copytree(base, target)
    weights = load_file(str(base / "model.safetensors"))
    save_file(_optimizer_step(weights, 1e-4, 0), str(target / "model.safetensors"), metadata={"format": "pt"})
    root = str(Path(__file__).resolve().parents[2])
    env = os.environ | {delta_select.ENV: asked}
    done = subprocess.run(
        [sys.executable, "-c", _SMALL_DELTA.format(root=root), str(base), str(target), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == expected
