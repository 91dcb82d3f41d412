"""prime_node/atomic_files.py: a replaced file is the old content or the new one, and nothing is left over."""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_node.atomic_files import atomic_writer, write_atomically
from prime_node.errors import NodeError


def test_write_replaces_the_whole_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "state.json"
    write_atomically(target, "old\n")
    write_atomically(target, b"new")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["state.json"]


def test_a_failed_write_keeps_the_old_content(tmp_path: Path) -> None:
    target = tmp_path / "log"
    target.write_text("kept")
    with pytest.raises(RuntimeError, match="midway"), atomic_writer(target, text=True) as handle:
        handle.write("half of the new")
        raise RuntimeError("midway")
    assert target.read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["log"]


def test_an_os_failure_is_a_node_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(NodeError) as caught:
        write_atomically(blocker / "child", "x")
    assert caught.value.reason == "io_error" and "writing" in str(caught.value)
