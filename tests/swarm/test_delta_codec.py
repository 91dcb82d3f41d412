"""Delta checkpoints: byte-identical round trips on real model directories, and hostile deltas refused."""

from __future__ import annotations

import json
import logging
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from prime_node.errors import NodeError
from prime_node.swarm.delta_codec import (
    CHUNK_SPARSE,
    FILE_RAW,
    FILE_TENSORS,
    MAGIC,
    MIN_CHUNK_BYTES,
    VERSION,
    DeltaError,
    DeltaStats,
    apply_delta,
    encode_delta,
)
from prime_node.swarm.delta_format import MANTISSA_BITS, Tensor
from prime_node.swarm.delta_order import visit, visit_order

Weights = dict[str, torch.Tensor]
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny qwen3 model as written for real (fp32), and the same weights cast to bf16."""
    from prime_node.ml.architectures import write_model_dir

    root = tmp_path_factory.mktemp("models")
    fp32 = write_model_dir("qwen3", "tiny", 0, root / "fp32")
    bf16 = root / "bf16"
    shutil.copytree(fp32, bf16)
    weights = load_file(str(fp32 / "model.safetensors"))
    _save(bf16, {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()})
    return {"fp32": fp32, "bf16": bf16}


def _save(directory: Path, weights: Weights) -> None:
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _variant(base: Path, out: Path, edit: Callable[[Weights], Weights]) -> Path:
    shutil.copytree(base, out)
    _save(out, edit(load_file(str(base / "model.safetensors"))))
    return out


def _files(directory: Path) -> dict[str, bytes]:
    return {
        path.relative_to(directory).as_posix(): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def _round_trip(base: Path, target: Path, work: Path, **options: int) -> DeltaStats:
    delta = work / "weights.delta"
    stats = encode_delta(base, target, delta, **options)
    out = work / "out"
    apply_delta(base, delta, out, max_output_bytes=stats.full_bytes)
    assert _files(out) == _files(target)
    assert stats.delta_bytes == delta.stat().st_size
    assert stats.full_bytes == sum(len(data) for data in _files(target).values())
    return stats


def _as_ints(tensor: torch.Tensor) -> torch.Tensor:
    kinds = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(kinds[tensor.element_size()])


def _changed_elements(before: Weights, after: Weights) -> int:
    return sum(int((_as_ints(before[name]) != _as_ints(after[name])).sum()) for name in after)


def _perturb(share: float, seed: int) -> Callable[[Weights], Weights]:
    """Move a random ``share`` of the values one representable step up (what a small update does)."""

    def edit(weights: Weights) -> Weights:
        generator = torch.Generator().manual_seed(seed)
        out = {}
        for name, tensor in weights.items():
            mask = torch.rand(tensor.shape, generator=generator) < share
            out[name] = torch.where(mask, torch.nextafter(tensor, torch.full_like(tensor, 10.0)), tensor)
        return out

    return edit


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_sparse_update_round_trips_small_and_counts_what_changed(
    model_dirs: dict[str, Path], precision: str, tmp_path: Path
) -> None:
    base = model_dirs[precision]
    target = _variant(base, tmp_path / "target", _perturb(0.01, seed=1))
    stats = _round_trip(base, target, tmp_path)
    before = load_file(str(base / "model.safetensors"))
    after = load_file(str(target / "model.safetensors"))
    changed = _changed_elements(before, after)
    assert stats.changed_values == changed and changed > 0
    assert stats.total_values == sum(tensor.numel() for tensor in after.values())
    # positions and values of ~1% of the elements, compressed: far below the 0.5 fallback share
    assert stats.delta_bytes < 0.05 * stats.full_bytes


def test_a_dense_update_round_trips_through_several_chunks(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    base = model_dirs["fp32"]
    target = _variant(base, tmp_path / "target", _perturb(0.7, seed=2))
    stats = _round_trip(base, target, tmp_path, chunk_bytes=MIN_CHUNK_BYTES)
    assert stats.changed_values > 0.6 * stats.total_values
    assert stats.delta_bytes < stats.full_bytes


def test_added_removed_reshaped_and_retyped_tensors_and_changed_files(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    base = model_dirs["bf16"]
    names = sorted(load_file(str(base / "model.safetensors")))

    def edit(weights: Weights) -> Weights:
        weights.pop(names[0])
        weights["extra.new_tensor"] = torch.arange(300, dtype=torch.float32)
        weights[names[1]] = weights[names[1]].reshape(-1)  # same bytes, other shape
        weights[names[2]] = weights[names[2]].to(torch.float32)  # other dtype and size
        weights[names[3]] = weights[names[3]][:1].clone()  # fewer elements
        return weights

    target = _variant(base, tmp_path / "target", edit)
    config = json.loads((target / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (target / "config.json").write_text(json.dumps(config))
    (target / "generation_config.json").unlink()
    (target / "extra").mkdir()
    (target / "extra" / "notes.txt").write_bytes(bytes(range(256)) * 50)
    _round_trip(base, target, tmp_path)


def test_an_unchanged_directory_is_a_few_hundred_bytes(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "target"
    shutil.copytree(model_dirs["fp32"], target)
    stats = _round_trip(model_dirs["fp32"], target, tmp_path)
    assert stats.changed_values == 0 and stats.delta_bytes < 1024


def test_without_a_usable_base_the_delta_carries_everything(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    stats = _round_trip(empty, model_dirs["bf16"], tmp_path)
    assert stats.changed_values == stats.total_values
    work = tmp_path / "other-precision"
    work.mkdir()
    stats = _round_trip(model_dirs["fp32"], model_dirs["bf16"], work)  # no tensor has the base's dtype
    assert stats.changed_values == stats.total_values


def _random_values(rng: np.random.Generator, count: int, dtype: torch.dtype, any_bits: bool) -> torch.Tensor:
    """Normal values, or random bit patterns (NaNs, infinities, negative zeros, subnormals among them)."""
    if not any_bits or count == 0:
        return torch.from_numpy(rng.standard_normal(count).astype(np.float32) * 100).to(dtype)
    width = torch.empty(0, dtype=dtype).element_size()
    bits = rng.integers(0, 256, count * width, dtype=np.uint8)
    return torch.from_numpy(bits).view(dtype)


@st.composite
def tensor_pairs(draw: st.DrawFn) -> tuple[Weights, Weights]:
    """Random base/target weights: shared names with random change masks, plus added and dropped ones."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base: Weights = {}
    target: Weights = {}
    for index in range(draw(st.integers(1, 5))):
        dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        count = draw(st.sampled_from([0, 1, 7, 1000, 40_000]))
        share = draw(st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]))
        values, moved = (_random_values(rng, count, dtype, draw(st.booleans())) for _ in range(2))
        changed = torch.from_numpy(rng.random(count) < share)
        where = draw(st.sampled_from(["both", "both", "added", "dropped"]))
        if where != "added":
            base[f"t{index}"] = values
        if where != "dropped":
            target[f"t{index}"] = torch.where(changed, moved, values)
    return base, target


@given(tensor_pairs())
@settings(max_examples=100, deadline=None)
def test_random_tensors_round_trip(pair: tuple[Weights, Weights]) -> None:
    base_weights, target_weights = pair
    with tempfile.TemporaryDirectory(prefix="delta-codec-") as name:
        work = Path(name)
        base, target = work / "base", work / "target"
        for directory, weights in ((base, base_weights), (target, target_weights)):
            directory.mkdir()
            (directory / "config.json").write_text("{}")
            _save(directory, weights)
        stats = _round_trip(base, target, work, chunk_bytes=MIN_CHUNK_BYTES)
        shared = {k: v for k, v in target_weights.items() if k in base_weights}
        fits = {k: v for k, v in shared.items() if base_weights[k].dtype == v.dtype}
        unfit = sum(v.numel() for k, v in target_weights.items() if k not in fits)
        assert stats.changed_values == _changed_elements(base_weights, fits) + unfit


# ------------------------------------------------------------------------------------------ hostile deltas


def _frame(data: bytes) -> bytes:
    compressed = zstandard.ZstdCompressor(write_content_size=True).compress(data)
    return struct.pack("<I", len(compressed)) + compressed


def _entry(path: bytes, size: int, kind: int, body: bytes, content: bytes) -> bytes:
    return (
        struct.pack("<H", len(path)) + path + struct.pack("<QB", size, kind) + body + blake3(content).digest()
    )


def _raw(path: bytes, content: bytes) -> bytes:
    return _entry(path, len(content), FILE_RAW, _frame(content) if content else b"", content)


def _delta(*entries: bytes, count: int | None = None, chunk: int = MIN_CHUNK_BYTES) -> bytes:
    body = MAGIC + struct.pack("<HII", VERSION, chunk, len(entries) if count is None else count)
    body += b"".join(entries)
    return body + blake3(body).digest()


def _safetensors(values: np.ndarray) -> tuple[bytes, bytes]:
    """(header, whole file) of a safetensors file holding ``values`` (float32) as tensor "w"."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(values)], "data_offsets": [0, values.nbytes]}})
    raw = header.encode()
    return raw, struct.pack("<Q", len(raw)) + raw + values.astype("<f4").tobytes()


def _f32_change(old: float, new: float) -> int:
    """The format's change of one float32, computed here from its definition (docs/deltas.md)."""

    def ordered(value: float) -> int:
        bits: int = struct.unpack("<I", struct.pack("<f", value))[0]
        return (~bits & 0xFFFFFFFF) if bits & 0x80000000 else bits | 0x80000000

    difference = (ordered(new) - ordered(old)) % 2**32
    signed = difference - 2**32 if difference >= 2**31 else difference
    return 2 * signed if signed >= 0 else -2 * signed - 1


def _sparse_tensor_file(gaps: list[int], width: int, changes: list[int]) -> tuple[bytes, bytes]:
    """A tensors entry with one sparse chunk over a base of 4 float32 values (the digest is of zeros)."""
    header, whole = _safetensors(np.zeros(4, dtype=np.float32))
    gap_planes = np.array(gaps, dtype=f"<u{width}").view(np.uint8).reshape(-1, width).T.tobytes()
    value_planes = np.array(changes, dtype="<u4").view(np.uint8).reshape(-1, 4).T.tobytes()
    body = struct.pack("<Q", len(header)) + _frame(header)
    body += struct.pack("<BBI", CHUNK_SPARSE, width, len(gaps)) + _frame(gap_planes + value_planes)
    return _entry(b"model.safetensors", len(whole), FILE_TENSORS, body, whole), whole


@pytest.fixture
def small_base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(_safetensors(np.zeros(4, dtype=np.float32))[1])
    return base


def _refused(
    base: Path, delta: bytes, work: Path, bound: int = 1 << 20, match: str | None = None
) -> DeltaError:
    """Apply ``delta``; it must be refused with nothing left behind, in ``out`` or beside it."""
    work.mkdir(exist_ok=True)
    (work / "d").write_bytes(delta)
    before = sorted(work.parent.rglob("*"))
    with pytest.raises(DeltaError, match=match) as info:
        apply_delta(base, work / "d", work / "out", max_output_bytes=bound)
    assert info.value.reason == "bad_delta"
    assert not (work / "out").exists()
    assert sorted(work.parent.rglob("*")) == before
    return info.value


def test_hand_built_deltas_apply(small_base: Path, tmp_path: Path) -> None:
    """The builders below make valid deltas: each hostile case differs from one of these in one field."""
    expected = np.array([0.0, 1.0, 0.0, -2.5], dtype=np.float32)
    entry, _ = _sparse_tensor_file([1, 1], 1, [_f32_change(0.0, 1.0), _f32_change(0.0, -2.5)])
    whole = _safetensors(expected)[1]
    entry = entry[:-32] + blake3(whole).digest()
    (tmp_path / "d").write_bytes(_delta(_raw(b"config.json", b"{}"), entry))
    apply_delta(small_base, tmp_path / "d", tmp_path / "out", max_output_bytes=1 << 20)
    assert _files(tmp_path / "out") == {"config.json": b"{}", "model.safetensors": whole}


def test_float_elements_are_visited_in_the_order_of_the_base_exponents(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    old = np.array([1.0, 0.0, 2.0, 0.5], dtype=np.float32)  # exponents 127, 0, 128, 126
    (base / "model.safetensors").write_bytes(_safetensors(old)[1])
    # visiting order: 0.0, 0.5, 1.0, 2.0; the third one visited (gap 2) is element 0
    entry, _ = _sparse_tensor_file([2], 1, [_f32_change(1.0, 3.0)])
    whole = _safetensors(np.array([3.0, 0.0, 2.0, 0.5], dtype=np.float32))[1]
    (tmp_path / "d").write_bytes(_delta(entry[:-32] + blake3(whole).digest()))
    apply_delta(base, tmp_path / "d", tmp_path / "out", max_output_bytes=1 << 20)
    assert _files(tmp_path / "out") == {"model.safetensors": whole}


@pytest.mark.parametrize(
    "name",
    [b"../evil", b"/etc/evil", b"a/../../evil", b"a//b", b"./a", b"a\\b", b"", b"con", b"\xff", b"a" * 300],
)
def test_file_names_outside_the_rules_are_refused(small_base: Path, tmp_path: Path, name: bytes) -> None:
    _refused(small_base, _delta(_raw(name, b"x")), tmp_path / "work")


@pytest.mark.parametrize(
    "names",
    [
        [b"b", b"a"],  # not sorted
        [b"a", b"a"],
        [b"A", b"a"],  # collide on a case-folding file system
        [b"a", b"a/b"],  # a file inside a file
        [b"A/b", b"a"],
    ],
)
def test_colliding_file_names_are_refused(small_base: Path, tmp_path: Path, names: list[bytes]) -> None:
    _refused(small_base, _delta(*(_raw(name, b"x") for name in names)), tmp_path / "work")


def test_huge_declared_lengths_are_refused_before_allocating(small_base: Path, tmp_path: Path) -> None:
    cases = {  # (the delta, what refuses it)
        "file size over the bound": _delta(_entry(b"a", 1 << 60, FILE_RAW, b"", b"")),
        "frame length": _delta(
            _entry(b"a", 10, FILE_RAW, struct.pack("<I", 0xFFFFFFFF) + b"\0" * 64, b"\0" * 10)
        ),
        "frame declaring more than its chunk": _delta(
            _entry(b"a", 10, FILE_RAW, _frame(b"\0" * (1 << 20)), b"\0" * 10)
        ),
        "safetensors header": _delta(
            _entry(b"m.safetensors", 100, FILE_TENSORS, struct.pack("<Q", 1 << 40), b"")
        ),
        "file count": _delta(count=1 << 30),
        "path length": _delta(struct.pack("<H", 0xFFFF) + b"a" * 100),
    }
    reasons = {
        "file size over the bound": "exceed",
        "frame length": "compressed block of",
        "frame declaring more than its chunk": "declares",
        "safetensors header": "safetensors header of",
        "file count": "files",
        "path length": "ends early",
    }
    for case, delta in cases.items():
        _refused(small_base, delta, tmp_path / case.replace(" ", "-"), bound=1 << 30, match=reasons[case])


@pytest.mark.parametrize(
    ("gaps", "width", "changes"),
    [
        ([4], 1, [1]),  # position 4 of 4 values
        ([0, 0xFFFFFFFFFFFFFFFF], 8, [1, 1]),  # wraps around to position 0 again
        ([0, 0, 0, 0], 1, [1, 1, 1, 1]),  # 4 x (1 + 4) bytes of positions and values for a 16-byte chunk
    ],
)
def test_sparse_positions_out_of_range_are_refused(
    small_base: Path, tmp_path: Path, gaps: list[int], width: int, changes: list[int]
) -> None:
    entry, _ = _sparse_tensor_file(gaps, width, changes)
    _refused(small_base, _delta(entry), tmp_path / "work", match="sparse chunk")


def test_truncated_and_bit_flipped_deltas_are_refused(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    base = model_dirs["bf16"]
    target = _variant(base, tmp_path / "target", _perturb(0.01, seed=3))
    stats = encode_delta(base, target, tmp_path / "good.delta", chunk_bytes=MIN_CHUNK_BYTES)
    good = (tmp_path / "good.delta").read_bytes()
    rng = np.random.default_rng(0)
    cuts = sorted({0, 1, 8, 30, len(good) - 1, len(good) - 32, *rng.integers(0, len(good), 30).tolist()})
    for cut in cuts:
        _refused(base, good[:cut], tmp_path / f"cut-{cut}", bound=stats.full_bytes)
    _refused(base, good + b"\0", tmp_path / "longer", bound=stats.full_bytes)
    flips = sorted({*range(0, 64), *rng.integers(0, len(good), 60).tolist(), len(good) - 1})
    for position in flips:
        flipped = bytearray(good)
        flipped[position] ^= 1 << int(rng.integers(0, 8))
        _refused(base, bytes(flipped), tmp_path / f"flip-{position}", bound=stats.full_bytes)


def test_a_wrong_or_missing_base_is_refused(
    model_dirs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base = model_dirs["fp32"]
    target = _variant(base, tmp_path / "target", _perturb(0.01, seed=4))
    stats = encode_delta(base, target, tmp_path / "good.delta")
    delta = (tmp_path / "good.delta").read_bytes()
    other = _variant(base, tmp_path / "other", _perturb(0.01, seed=5))  # same layout, other values
    with caplog.at_level(logging.WARNING, logger="prime_node.swarm.delta_codec"):
        _refused(other, delta, tmp_path / "wrong", bound=stats.full_bytes, match="digest")
    assert len(caplog.records) == 1 and "refused delta" in caplog.records[0].getMessage()
    _refused(tmp_path / "nowhere", delta, tmp_path / "missing", bound=stats.full_bytes, match="no file")
    _refused(base, delta, tmp_path / "bound", bound=stats.full_bytes - 1, match="bound")


def test_an_existing_output_directory_is_not_touched(small_base: Path, tmp_path: Path) -> None:
    (tmp_path / "d").write_bytes(_delta(_raw(b"config.json", b"{}")))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_bytes(b"mine")
    with pytest.raises(NodeError) as info:
        apply_delta(small_base, tmp_path / "d", tmp_path / "out", max_output_bytes=1 << 20)
    assert info.value.reason == "output_exists"
    assert _files(tmp_path / "out") == {"keep": b"mine"}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_delta_and_its_output_do_not_depend_on_the_threads(
    model_dirs: dict[str, Path], precision: str, tmp_path: Path
) -> None:
    """Chunks are coded in a thread pool and written in order: any thread count gives the same bytes."""
    base = model_dirs[precision]
    target = _variant(base, tmp_path / "target", _perturb(0.3, seed=3))
    deltas = []
    for threads in (1, 3):
        delta = tmp_path / f"{threads}.delta"
        encode_delta(base, target, delta, chunk_bytes=MIN_CHUNK_BYTES, threads=threads)
        deltas.append(delta.read_bytes())
        out = tmp_path / f"out-{threads}"
        apply_delta(base, delta, out, max_output_bytes=1 << 30, threads=4 - threads)
        assert _files(out) == _files(target)
    assert deltas[0] == deltas[1]
    with pytest.raises(ValueError, match="threads"):
        encode_delta(base, target, tmp_path / "none.delta", threads=0)


_FLOAT_TENSORS = [("BF16", 2), ("F16", 2), ("F32", 4), ("F64", 8), ("F8_E4M3", 1), ("F8_E5M2", 1)]


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(_FLOAT_TENSORS),
    data=st.binary(min_size=8, max_size=4096),
    flag_seed=st.integers(0, 2**32 - 1),
)
def test_the_visiting_order_is_the_stable_sort_of_the_base_exponents(
    kind: tuple[str, int], data: bytes, flag_seed: int
) -> None:
    """The one-key sort (exponent, index, flag) is exactly a stable argsort of the exponents, and the
    flag bit gives the flagged elements' visiting positions."""
    dtype, width = kind
    count = len(data) // width
    old = np.frombuffer(data[: count * width], dtype=f"<u{width}")
    tensor = Tensor("t", dtype, 0, count * width, width)
    mantissa = MANTISSA_BITS[dtype]
    exponent = (old >> old.dtype.type(mantissa)) & old.dtype.type((1 << (8 * width - mantissa - 1)) - 1)
    expected = np.argsort(exponent, kind="stable")
    order = visit_order(old, tensor)
    assert order is not None and np.array_equal(order, expected)
    flags = np.random.default_rng(flag_seed).random(count) < 0.3
    flagged_order, positions = visit(old, tensor, flags)
    assert np.array_equal(flagged_order, expected)
    assert positions is not None and np.array_equal(positions, np.flatnonzero(flags[expected]))
