"""BatchArchive (``--keep-batches``): bounded, safely named, atomic copies of the signed batches seen."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prime_node.atomic_files import temporary_sibling
from prime_node.config.run import RunConfig
from prime_node.node_config import NodeConfig
from prime_node.verification import batch_archive
from prime_node.verification.batch_archive import (
    BatchArchive,
    find_policy,
    label_of,
    open_archive,
    read_note,
    read_run_config,
)

ADDRESS = "0x" + "ab" * 20
frames = st.binary(min_size=0, max_size=300)
ids = st.text(max_size=80) | st.text(alphabet="0123456789abcdef", min_size=16, max_size=64)
steps = st.integers(min_value=0, max_value=(1 << 63) - 1)


def policy_dir(root: Path, name: str) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"weights")
    return directory


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def disk_bytes(directory: Path) -> int:
    if not directory.is_dir():
        return 0
    return sum(p.stat().st_size for p in directory.iterdir() if p.suffix in (".batch", ".json"))


# -- bounds and names (properties) -------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batches=st.lists(st.tuples(frames, ids, steps), max_size=12),
    max_batches=st.integers(1, 5),
    max_bytes=st.integers(1, 3000),
)
def test_the_archive_never_holds_more_than_its_bounds(
    tmp_path_factory: pytest.TempPathFactory,
    batches: list[tuple[bytes, str, int]],
    max_batches: int,
    max_bytes: int,
) -> None:
    directory = tmp_path_factory.mktemp("archive") / "batches"
    archive = BatchArchive(directory, max_batches, max_bytes)
    kept: list[tuple[Path, bytes]] = []
    for frame, batch_id, step in batches:
        path = archive.keep(frame, batch_id=batch_id, worker=ADDRESS, policy_step=step)
        if path is not None:
            kept.append((path, frame))
            assert path.read_bytes() == frame  # exactly as received
        listed = archive.list_kept()
        assert len(listed) <= max_batches
        assert disk_bytes(directory) == sum(item.size for item in listed) == archive.bytes_kept <= max_bytes
        assert [item.seq for item in listed] == sorted(item.seq for item in listed)
    # the newest kept batch is always there, and what is listed is the newest ones, in order
    listed_paths = [item.path for item in archive.list_kept()]
    if kept:
        assert listed_paths[-1] == kept[-1][0]
        assert listed_paths == [path for path, _ in kept][-len(listed_paths) :]
    # a restart finds the same batches
    assert [item.path for item in BatchArchive(directory, max_batches, max_bytes).list_kept()] == listed_paths


@settings(max_examples=200, deadline=None)
@given(batch_id=st.text(max_size=300))
def test_a_file_name_never_takes_a_character_of_a_hostile_id(batch_id: str) -> None:
    label = label_of(batch_id)
    assert len(label) == 16 and set(label) <= set("0123456789abcdef")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch_id=ids | st.sampled_from(["../../etc/passwd", "/abs", "a/b", "\x00", ".", "..", "x" * 5000]))
def test_every_file_lands_inside_the_directory(
    tmp_path_factory: pytest.TempPathFactory, batch_id: str
) -> None:
    root = tmp_path_factory.mktemp("names")
    directory = root / "batches"
    path = BatchArchive(directory, 3, 1 << 20).keep(
        b"frame", batch_id=batch_id, worker=batch_id, policy_step=1
    )
    assert path is not None and path.parent == directory
    assert files_in(root) == ["batches"] and len(files_in(directory)) == 2
    note = read_note(path)
    assert note is not None and note.batch_id == batch_id[: batch_archive.MAX_TEXT]


def test_a_hex_id_names_the_file_by_its_first_16_characters(tmp_path: Path) -> None:
    batch_id = "0123456789abcdef" * 4
    path = BatchArchive(tmp_path, 2, 1 << 20).keep(b"x", batch_id=batch_id, worker=ADDRESS, policy_step=3)
    assert path is not None and path.name == "00000000-0123456789abcdef.batch"


def test_a_frame_larger_than_the_archive_is_skipped_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    archive = BatchArchive(tmp_path, 4, 500)
    first = archive.keep(b"a" * 100, batch_id="a" * 16, worker=ADDRESS, policy_step=0)
    with caplog.at_level("WARNING"):
        assert archive.keep(b"b" * 501, batch_id="b" * 16, worker=ADDRESS, policy_step=0) is None
    assert "not keeping batch bbbbbbbbbbbbbbbb" in caplog.text and archive.skipped == 1
    assert [item.path for item in archive.list_kept()] == [first]  # the old one is not evicted for it


def test_bad_bounds_are_refused(tmp_path: Path) -> None:
    for bounds in ((0, 10), (1, 0), (-1, -1)):
        with pytest.raises(ValueError):
            BatchArchive(tmp_path, *bounds)


# -- the sidecar -----------------------------------------------------------------------------------------


def test_the_sidecar_names_the_claim_the_policy_and_the_run(tmp_path: Path) -> None:
    policies = tmp_path / "out" / "policies"
    claimed = policy_dir(policies, "step_00000007")
    swarm = tmp_path / "data" / "swarm" / "checkpoints"
    delta_only = swarm / "step-8-00112233aabbccdd"
    delta_only.mkdir(parents=True)
    (delta_only / "weights.delta").write_bytes(b"d")
    full = policy_dir(swarm, "step-8-ffeeddccbbaa9988")
    run = RunConfig(run_id="r1", max_steps=9)
    archive = BatchArchive(
        tmp_path / "data" / "batches", 5, 1 << 20, policy_roots=(policies, swarm), run_config=run
    )
    seven = archive.keep(
        b"seven", batch_id="77" * 32, worker=ADDRESS, policy_step=7, received_at=1700000000.5
    )
    eight = archive.keep(b"eight", batch_id="88" * 32, worker=ADDRESS, policy_step=8)
    missing = archive.keep(b"nine", batch_id="99" * 32, worker=ADDRESS, policy_step=9)
    assert seven and eight and missing
    note = read_note(seven)
    assert note is not None
    assert (note.batch_id, note.worker, note.policy_step) == ("77" * 32, ADDRESS, 7)
    assert note.received_at == 1700000000.5 and note.policy_dir == claimed
    assert note.policy_roots == (policies, swarm)
    assert note.run_config == tmp_path / "data" / "batches" / "run-r1.json"
    assert read_run_config(note.run_config) == run  # the saved config is the run's, every field
    eighth = read_note(eight)
    assert eighth is not None and eighth.policy_dir == full  # the full version, never a delta's directory
    assert eighth.received_at == pytest.approx(eight.stat().st_mtime)  # no time given: the file's
    ninth = read_note(missing)
    assert ninth is not None and ninth.policy_dir is None and ninth.policy_roots == (policies, swarm)


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b"[]", b'{"format": 1}', b'{"format": 1, "policy_step": "7"}', b"[" * 100_000, b"x" * 20_000],
)
def test_a_damaged_sidecar_is_ignored(tmp_path: Path, content: bytes) -> None:
    batch = tmp_path / "00000000-0011223344556677.batch"
    batch.write_bytes(b"frame")
    batch.with_suffix(".json").write_bytes(content)
    assert read_note(batch) is None


def test_a_sidecar_cannot_point_the_config_outside_its_directory(tmp_path: Path) -> None:
    batch = tmp_path / "00000000-0011223344556677.batch"
    batch.write_bytes(b"frame")
    note = {"format": 1, "policy_step": 1, "run_config": "../../etc/run-x.json"}
    batch.with_suffix(".json").write_text(json.dumps(note))
    found = read_note(batch)
    assert found is not None and found.run_config is None


def test_the_sidecar_paths_do_not_depend_on_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node started with a relative --data-dir; `validate` run from anywhere else."""
    monkeypatch.chdir(tmp_path)
    policy = policy_dir(Path("node/swarm/checkpoints"), "step-2-0011223344556677")
    archive = BatchArchive(Path("node/batches"), 3, 1 << 20, policy_roots=(Path("node/swarm/checkpoints"),))
    path = archive.keep(b"x", batch_id="a" * 16, worker=ADDRESS, policy_step=2)
    assert path is not None
    monkeypatch.chdir("/")
    note = read_note(tmp_path / path)
    assert note is not None and note.policy_dir == tmp_path / policy
    assert note.policy_roots == (tmp_path / "node/swarm/checkpoints",)


def test_find_policy_reads_both_layouts_and_refuses_others(tmp_path: Path) -> None:
    assert find_policy([tmp_path], 3) is None
    (tmp_path / "step_00000003").mkdir()  # no config.json or weights: not loadable
    assert find_policy([tmp_path], 3) is None
    swarm = policy_dir(tmp_path, "step-3-0011223344556677")
    assert find_policy([tmp_path / "missing", tmp_path], 3) == swarm
    assert find_policy([tmp_path], 33) is None and find_policy([tmp_path], -3) is None
    trainer = policy_dir(tmp_path / "policies", "step_00000003")
    assert find_policy([tmp_path / "policies", tmp_path], 3) == trainer


def test_open_archive_follows_the_node_config(tmp_path: Path) -> None:
    assert open_archive(NodeConfig(data_dir=tmp_path)) is None
    config = NodeConfig(data_dir=tmp_path).keeping_batches(5)
    archive = open_archive(config)
    assert archive is not None and archive.directory == tmp_path / "batches" and archive.max_batches == 5
    with pytest.raises(ValueError):
        NodeConfig(data_dir=tmp_path).keeping_batches(-1)


# -- atomicity, restarts and failures on real files --------------------------------------------------------


def test_a_restart_removes_crash_leftovers_and_continues_the_sequence(tmp_path: Path) -> None:
    archive = BatchArchive(tmp_path, 10, 1 << 20)
    first = archive.keep(b"one", batch_id="a" * 16, worker=ADDRESS, policy_step=0)
    assert first is not None
    half_written = temporary_sibling(tmp_path / "00000001-bbbbbbbbbbbbbbbb.batch")
    half_written.write_bytes(b"half")
    lost_note = tmp_path / "00000002-cccccccccccccccc.json"  # its batch never arrived
    lost_note.write_text("{}")
    no_note = tmp_path / "00000003-dddddddddddddddd.batch"  # killed between the two renames
    no_note.write_bytes(b"three")
    foreign = tmp_path / "notes.txt"
    foreign.write_text("the user's own file")
    restarted = BatchArchive(tmp_path, 10, 1 << 20)
    listed = restarted.list_kept()
    assert [item.path for item in listed] == [first, no_note] and listed[1].note is None
    assert not half_written.exists() and not lost_note.exists() and foreign.exists()
    nxt = restarted.keep(b"four", batch_id="e" * 16, worker=ADDRESS, policy_step=0)
    assert nxt is not None and nxt.name.startswith("00000004-")


def test_a_failed_write_leaves_no_partial_file_and_keeps_the_old_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    archive = BatchArchive(tmp_path, 10, 1 << 20)
    first = archive.keep(b"one", batch_id="a" * 16, worker=ADDRESS, policy_step=0)
    before = files_in(tmp_path)
    real_fsync = os.fsync

    def full_disk(descriptor: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with caplog.at_level("WARNING"):
        assert archive.keep(b"two", batch_id="b" * 16, worker=ADDRESS, policy_step=0) is None
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert "disk full" in caplog.text
    assert files_in(tmp_path) == before and [i.path for i in archive.list_kept()] == [first]


def test_a_failed_sidecar_write_removes_its_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = BatchArchive(tmp_path, 10, 1 << 20)
    real = batch_archive.write_atomically

    def notes_fail(path: Path, data: bytes | str, **kwargs: object) -> None:
        if path.suffix == ".json":
            from prime_node.errors import NodeError

            raise NodeError("disk full while writing", reason="disk_full")
        real(path, data)

    monkeypatch.setattr(batch_archive, "write_atomically", notes_fail)
    assert archive.keep(b"x", batch_id="a" * 16, worker=ADDRESS, policy_step=0) is None
    assert files_in(tmp_path) == [] and archive.list_kept() == []


def test_a_directory_that_cannot_be_created_is_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "batches"
    blocker.write_text("a file where the directory should be")
    archive = BatchArchive(blocker, 3, 1 << 20)
    with caplog.at_level("WARNING"):
        assert archive.keep(b"x", batch_id="a" * 16, worker=ADDRESS, policy_step=0) is None
        assert archive.list_kept() == []
    assert "not keeping batch" in caplog.text and blocker.read_text().startswith("a file")


def test_threads_keeping_at_once_stay_within_the_bounds(tmp_path: Path) -> None:
    archive = BatchArchive(tmp_path, 7, 1 << 20)

    def keep_many(worker: int) -> None:
        for n in range(20):
            archive.keep(
                bytes([worker]) * 50, batch_id=f"{worker:02x}{n:014x}", worker=ADDRESS, policy_step=n
            )

    threads = [threading.Thread(target=keep_many, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    listed = archive.list_kept()
    assert len(listed) == 7 and archive.kept == 80 and archive.evicted == 73
    assert sorted(files_in(tmp_path)) == sorted(
        name for item in listed for name in (item.path.name, item.path.with_suffix(".json").name)
    )


@pytest.mark.parametrize(
    "content", [b"[" * 100_000, b"{}" + b" " * (2 << 20), b"[]", b'{"group_size": "x"}', b"\xff"]
)
def test_a_damaged_saved_run_config_is_a_clear_error(tmp_path: Path, content: bytes) -> None:
    from prime_node.errors import NodeError

    path = tmp_path / "run-x.json"
    path.write_bytes(content)
    with pytest.raises(NodeError) as raised:
        read_run_config(path)
    assert raised.value.reason == "bad_config"
