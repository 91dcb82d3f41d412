"""One node per data dir (``node.data_dir_lock``): another process holding it is named, a dead holder's
lock is gone with it, and a check creates nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prime_node.errors import NodeError
from prime_node.node.data_dir_lock import DataDirLock, check_data_dir_free

HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from prime_node.node.data_dir_lock import DataDirLock
    with DataDirLock(Path(sys.argv[1])):
        print("held", flush=True)
        sys.stdin.read()  # until the test closes our stdin
    """
)


def test_a_data_dir_held_by_another_process_is_refused_with_its_pid_until_it_exits(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(NodeError, match=f"is in use by pid {holder.pid} ") as refused:
            check_data_dir_free(tmp_path)
        assert refused.value.reason == "data_dir_busy"
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    # the holder is gone, and its lock with it; a second lock, even in one process, is refused
    with DataDirLock(tmp_path), pytest.raises(NodeError, match="in use by pid"):
        check_data_dir_free(tmp_path)


def test_checking_a_data_dir_that_does_not_exist_creates_nothing(tmp_path: Path) -> None:
    check_data_dir_free(tmp_path / "nope")
    assert not (tmp_path / "nope").exists()
