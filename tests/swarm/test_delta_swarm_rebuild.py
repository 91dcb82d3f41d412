"""Delta versions on disk (prime_node/swarm/delta_versions.py): the trainer's encode-and-sign, and a peer's
rebuild checked against the target's own manifest (all or nothing)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.swarm.checkpoint_pieces import build_checkpoint
from prime_node.swarm.delta_versions import check_against, encode_delta_version, rebuild_full
from prime_node.testing.swarm_fixtures import read_tree, write_model_dir
from protocol.manifest import DELTA_FILE_NAME, open_manifest
from tests.swarm.test_delta_swarm import evolve

KEY = WalletKey(bytes(31) + b"\x05")


def two_steps(tmp_path: Path) -> tuple[Path, Path]:
    first = write_model_dir(tmp_path / "step0", weight_bytes=256 << 10)
    return first, evolve(first, tmp_path / "step1", seed=1)


def test_a_signed_delta_rebuilds_its_target_byte_identical(tmp_path: Path) -> None:
    base_dir, target_dir = two_steps(tmp_path)
    base = build_checkpoint(base_dir, KEY, run="r", step=0, now_ms=1)
    target = build_checkpoint(target_dir, KEY, run="r", step=1, now_ms=1)
    work = tmp_path / "work"
    work.mkdir()
    delta, stats = encode_delta_version(
        base_dir,
        target_dir,
        work,
        KEY,
        full=target.manifest,
        base_id=base.manifest_id,
        now_ms=1,
        max_bytes=1 << 30,
    )
    assert delta is not None and stats.delta_bytes < target.manifest.total_size // 4
    manifest = open_manifest(delta.envelope, trainer=KEY.address, run="r", expected_id=delta.manifest_id)
    assert (manifest.base, manifest.target, manifest.step) == (base.manifest_id, target.manifest_id, 1)
    assert [p.name for p in delta.directory.iterdir()] == [DELTA_FILE_NAME]
    out = tmp_path / "rebuilt"
    rebuild_full(base_dir, delta.directory / DELTA_FILE_NAME, target.manifest, out)
    assert read_tree(out) == read_tree(target_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rebuilt", "step0", "step1", "work"]


def test_a_delta_over_the_size_bound_leaves_nothing(tmp_path: Path) -> None:
    base_dir, target_dir = two_steps(tmp_path)
    target = build_checkpoint(target_dir, KEY, run="r", step=1, now_ms=1)
    work = tmp_path / "work"
    work.mkdir()
    delta, stats = encode_delta_version(
        base_dir, target_dir, work, KEY, full=target.manifest, base_id=b"\x01" * 32, now_ms=1, max_bytes=10
    )
    assert delta is None and stats.delta_bytes > 10
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("how", ["other_target", "truncated", "extra_file"])
def test_a_rebuild_that_is_not_the_target_is_refused_and_leaves_nothing(tmp_path: Path, how: str) -> None:
    base_dir, target_dir = two_steps(tmp_path)
    other = evolve(base_dir, tmp_path / "other", seed=5)
    target = build_checkpoint(target_dir, KEY, run="r", step=1, now_ms=1)
    work = tmp_path / "work"
    work.mkdir()
    encoded = other if how == "other_target" else target_dir
    if how == "extra_file":
        encoded = tmp_path / "extra"
        shutil.copytree(target_dir, encoded)
        (encoded / "notes.txt").write_text("not part of the version")
    delta, _ = encode_delta_version(
        base_dir, encoded, work, KEY, full=target.manifest, base_id=b"\x01" * 32, now_ms=1, max_bytes=1 << 30
    )
    assert delta is not None
    delta_file = delta.directory / DELTA_FILE_NAME
    if how == "truncated":
        delta_file.write_bytes(delta_file.read_bytes()[:-100])
    out = tmp_path / "parent" / "rebuilt"
    out.parent.mkdir()
    with pytest.raises(NodeError) as caught:
        rebuild_full(base_dir, delta_file, target.manifest, out)
    assert caught.value.reason == "bad_delta"
    assert list(out.parent.iterdir()) == []  # no output, no work directory


def test_check_against_names_a_wrong_piece(tmp_path: Path) -> None:
    _, target_dir = two_steps(tmp_path)
    target = build_checkpoint(target_dir, KEY, run="r", step=1, now_ms=1, piece_size=16 << 10)
    check_against(target_dir, target.manifest)
    shard = sorted(target_dir.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(NodeError, match="piece"):
        check_against(target_dir, target.manifest)
