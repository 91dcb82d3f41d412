"""``prime-node demo`` refuses bad flags with one line, before it creates or starts anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests import warm_cli


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "prime_node", "demo", *args]
    return warm_cli.run(command, capture_output=True, text=True, timeout=120, check=False)


def _one_line_error(result: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def test_an_unknown_attack_is_refused(tmp_path: Path) -> None:
    result = _demo("--adversary", "nonsense", "--workdir", str(tmp_path / "w"))
    _one_line_error(result, "unknown --adversary 'nonsense'")
    assert not (tmp_path / "w").exists()


def test_a_non_empty_workdir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    result = _demo("--workdir", str(tmp_path))
    _one_line_error(result, "is not empty")
    assert [p.name for p in tmp_path.iterdir()] == ["precious.txt"]
