"""The piece store and checkpoint reading: verify on write, resume, atomic output, disk errors."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.swarm.checkpoint_pieces import (
    SharedCheckpoint,
    build_checkpoint,
    choose_piece_size,
    list_model_files,
    read_piece_from_files,
)
from prime_node.swarm.piece_store import PROGRESS_FILE, PieceStore
from prime_node.testing.swarm_fixtures import read_tree, write_model_dir
from protocol.manifest import open_manifest

KEY = WalletKey(bytes(31) + b"\x05")
PIECE = 4096


def share(tmp_path: Path, *, step: int = 1, seed: int = 0, name: str = "model") -> SharedCheckpoint:
    source = write_model_dir(tmp_path / name, weight_bytes=60_000, seed=seed)
    return build_checkpoint(
        source, KEY, run="demo", step=step, now_ms=int(time.time() * 1000), piece_size=PIECE
    )


def fill(store: PieceStore, shared: SharedCheckpoint, indices: range | list[int]) -> None:
    for index in indices:
        assert store.write(index, read_piece_from_files(shared.directory, shared.manifest, index))


def test_build_checkpoint_describes_the_directory(tmp_path: Path) -> None:
    shared = share(tmp_path)
    manifest = open_manifest(shared.envelope, trainer=KEY.address, run="demo", expected_id=shared.manifest_id)
    files = read_tree(shared.directory)
    assert [f.path for f in manifest.files] == sorted(files)
    assert manifest.total_size == sum(len(v) for v in files.values())
    stream = b"".join(files[name] for name in sorted(files))
    pieces = [read_piece_from_files(shared.directory, manifest, i) for i in range(manifest.piece_count)]
    assert b"".join(pieces) == stream
    assert all(manifest.piece_is_valid(i, p) for i, p in enumerate(pieces))


def test_directories_that_are_not_models_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(NodeError) as empty:
        list_model_files(tmp_path / "empty")
    assert empty.value.reason == "not_a_model_dir"
    with pytest.raises(NodeError):
        list_model_files(tmp_path / "absent")
    odd = write_model_dir(tmp_path / "odd")
    (odd / "bad name.txt").write_text("x")
    with pytest.raises(NodeError) as bad:
        list_model_files(odd)
    assert bad.value.reason == "bad_model_file"
    with pytest.raises(NodeError):
        choose_piece_size(10, 3000)
    assert choose_piece_size(10) == 256 << 10
    assert choose_piece_size(256 << 20) == 1 << 20  # 256 pieces
    assert choose_piece_size(256 * 10**6) == 1 << 20  # 245 pieces (benchmarks/broadcast.py's checkpoint)
    assert choose_piece_size(100 * 10**6) == 256 << 10  # 382 pieces: 512 KiB would give 191
    assert choose_piece_size(62 << 30) == 4 << 20  # 15,872 pieces
    assert choose_piece_size(1 << 40) == 8 << 20  # doubled to fit MAX_PIECES (131,072)


def test_write_verifies_and_a_download_materializes_byte_identical(tmp_path: Path) -> None:
    shared = share(tmp_path)
    manifest = shared.manifest
    store = PieceStore.open(tmp_path / "store", manifest)
    good = read_piece_from_files(shared.directory, manifest, 0)
    assert not store.write(0, b"\x00" + good[1:])
    assert not store.write(0, good[:-1])
    assert not store.has(0)
    fill(store, shared, range(manifest.piece_count))
    assert store.complete
    store.materialize(tmp_path / "out")
    assert read_tree(tmp_path / "out") == read_tree(shared.directory)
    assert store.read(1) == read_piece_from_files(shared.directory, manifest, 1)


def test_reopening_resumes_from_verified_pieces_only(tmp_path: Path) -> None:
    shared = share(tmp_path)
    manifest = shared.manifest
    store = PieceStore.open(tmp_path / "store", manifest)
    fill(store, shared, [0, 2, 3, 5])
    with pytest.raises(NodeError) as busy:
        PieceStore.open(tmp_path / "store", manifest)
    assert busy.value.reason == "store_busy"
    store.close()
    again = PieceStore.open(tmp_path / "store", manifest)
    assert again.have == store.have == 0b101101
    again.close()
    # Damage piece 2's bytes on disk: the re-check on open drops it.
    file_index, offset, _, _ = again.segments(2)[0]
    with open(again.files / manifest.files[file_index].path, "r+b") as handle:
        handle.seek(offset + 10)
        handle.write(b"\xff\xff")
    with PieceStore.open(tmp_path / "store", manifest) as damaged:
        assert damaged.have == 0b101001
    (again.directory / PROGRESS_FILE).write_bytes(b"garbage that is not a bitfield")
    with PieceStore.open(tmp_path / "store", manifest) as garbled:
        assert garbled.have == 0


def test_output_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = share(tmp_path)
    store = PieceStore.open(tmp_path / "store", shared.manifest)
    out = tmp_path / "out"
    with pytest.raises(NodeError) as incomplete:
        store.materialize(out)
    assert incomplete.value.reason == "incomplete" and not out.exists()
    fill(store, shared, range(shared.manifest.piece_count))

    real_fsync = os.fsync
    calls = {"n": 0}

    def failing_fsync(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # after two files are already written
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(NodeError) as full:
        store.materialize(out)
    assert full.value.reason == "disk_full"
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    monkeypatch.setattr(os, "fsync", real_fsync)
    store.materialize(out)
    assert read_tree(out) == read_tree(shared.directory)
    with pytest.raises(NodeError) as exists:
        store.materialize(out)
    assert exists.value.reason == "output_exists"
    with pytest.raises(NodeError) as moved:
        store.materialize(tmp_path / "elsewhere")
    assert moved.value.reason == "store_moved" and not (tmp_path / "elsewhere").exists()


def test_finishing_a_download_renames_its_files_into_place_and_copies_nothing(tmp_path: Path) -> None:
    shared = share(tmp_path)
    manifest = shared.manifest
    store = PieceStore.open(tmp_path / "store", manifest)
    fill(store, shared, range(manifest.piece_count))
    before = {e.path: os.stat(store.files / e.path).st_ino for e in manifest.files}
    served_before = store.read(3)  # the event loop keeps serving from descriptors it holds...
    out = tmp_path / "checkpoints" / "step-1"
    store.materialize(out)
    assert {e.path: os.stat(out / e.path).st_ino for e in manifest.files} == before
    assert not store.files.exists()
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o755)
    assert read_tree(out) == read_tree(shared.directory)
    store.close()  # ...and opens the moved files by their new path once it has no descriptor left
    for index in range(manifest.piece_count):
        assert store.read(index) == read_piece_from_files(shared.directory, manifest, index)
    assert store.read(3) == served_before
    store.have &= ~1  # as if piece 0 were missing: nothing may be written into the output any more
    with pytest.raises(NodeError) as moved:
        store.write(0, read_piece_from_files(shared.directory, manifest, 0))
    assert moved.value.reason == "store_moved"
    store.close()
    store.remove()
    assert not store.directory.exists() and read_tree(out) == read_tree(shared.directory)


def test_an_output_on_another_file_system_is_copied_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = share(tmp_path)
    store = PieceStore.open(tmp_path / "store", shared.manifest)
    fill(store, shared, range(shared.manifest.piece_count))
    real_rename = os.rename

    def across_devices(source: Path, target: Path) -> None:
        if Path(source) == store.files:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", across_devices)
    out = tmp_path / "other-disk" / "out"
    store.materialize(out)
    assert read_tree(out) == read_tree(shared.directory)
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o755)
    assert [p.name for p in out.parent.iterdir()] == ["out"]  # no staging left behind
    assert read_tree(store.files) == read_tree(shared.directory)  # copied, not moved
    store.close()
    store.remove()
    assert read_tree(out) == read_tree(shared.directory)


def test_a_store_whose_files_left_with_a_killed_run_or_of_the_old_layout_starts_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = share(tmp_path)
    manifest = shared.manifest
    store = PieceStore.open(tmp_path / "store", manifest)
    fill(store, shared, range(manifest.piece_count))
    store.materialize(tmp_path / "out")
    store.close()  # killed before ``remove``: the store's progress claims every piece, its files are gone
    with caplog.at_level("WARNING"), PieceStore.open(tmp_path / "store", manifest) as again:
        assert again.have == 0
        assert [e.path for e in manifest.files] == sorted(read_tree(again.files))
        fill(again, shared, [0, 1])
    failed = [r.getMessage() for r in caplog.records if "failed their re-check" in r.getMessage()]
    assert len(failed) == 1 and failed[0].startswith(f"{manifest.piece_count} pieces")
    legacy = tmp_path / "store" / manifest.id().hex()
    (legacy / "pieces.bin").write_bytes(b"\0" * manifest.total_size)
    with PieceStore.open(tmp_path / "store", manifest) as old:
        assert old.have == 0 and not (legacy / "pieces.bin").exists()


def test_a_stale_partial_directory_from_a_killed_run_is_cleaned(tmp_path: Path) -> None:
    shared = share(tmp_path)
    store = PieceStore.open(tmp_path / "store", shared.manifest)
    fill(store, shared, range(shared.manifest.piece_count))
    stale = tmp_path / ".out.partial-abc123"
    stale.mkdir()
    (stale / "config.json").write_text("half")
    store.materialize(tmp_path / "out")
    assert not stale.exists()


def test_disk_full_and_permission_denied_are_clear_and_leave_consistent_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = share(tmp_path)
    manifest = shared.manifest

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(NodeError) as full:
        PieceStore.open(tmp_path / "store", manifest)
    assert full.value.reason == "disk_full"
    assert "disk full" in str(full.value)
    monkeypatch.undo()

    store = PieceStore.open(tmp_path / "store", manifest)
    fill(store, shared, [0])

    def denied(fd: int, data: bytes, offset: int) -> int:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "pwrite", denied)
    with pytest.raises(NodeError) as perm:
        store.write(1, read_piece_from_files(shared.directory, manifest, 1))
    assert perm.value.reason == "permission_denied"
    assert store.have == 0b1
    monkeypatch.undo()
    store.close()
    with PieceStore.open(tmp_path / "store", manifest) as reopened:
        assert reopened.have == 0b1
