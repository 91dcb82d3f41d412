"""The code checker's sandbox: hostile programs score 0 quickly and leave nothing running."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from prime_node.tasks.code import CodeTask, extract_code
from prime_node.tasks.sandbox import run_python
from tests.tasks.processes import naming_prelude, new_tag, processes_left

TIMEOUT = 2.0
HOSTILE = {
    "infinite_loop": "while True:\n    pass\n",
    "sleep": "import time\ntime.sleep(60)\n",
    "huge_allocation": "block = bytearray(16 * 1024 ** 3)\n",
    "growing_allocation": "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 1024 ** 2))\n",
    "network_socket": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\n",
    "network_raw_socket": "import _socket\ns = _socket.socket()\ns.connect(('1.1.1.1', 80))\n",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "crash": "import os\nos.abort()\n",
    "exit_nonzero": "raise SystemExit(3)\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_scores_zero_quickly(name: str) -> None:
    tag = new_tag()
    started = time.monotonic()
    result = run_python(naming_prelude(tag) + HOSTILE[name], timeout_s=TIMEOUT, memory_mb=256)
    assert not result.passed
    # Killed at its timeout, not left to run (the sleeper asks for 60 s), at 10 x the limit since a loaded
    # machine stretches start-up and teardown.
    assert time.monotonic() - started < 10 * TIMEOUT  # hang guard
    assert processes_left(tag) == []  # nothing it started (the fork bomb's children) outlives it


def test_honest_program_passes_and_failing_tests_fail() -> None:
    assert run_python("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\n", timeout_s=10).passed
    assert not run_python("assert 1 == 2\n", timeout_s=10).passed


def test_network_is_unreachable_even_without_the_socket_module_guard() -> None:
    result = run_python("import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', 1))\n", timeout_s=10)
    assert "Network is unreachable" in result.stderr_tail


def test_code_task_scores_completions(tmp_path: Path) -> None:
    path = tmp_path / "code.jsonl"
    rows = [{"prompt": "Write square(x).", "tests": "assert square(3) == 9\nassert square(-2) == 4\n"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = CodeTask.from_file(path, timeout_s=TIMEOUT)
    good = "Here it is:\n```python\ndef square(x):\n    return x * x\n```\n"
    assert extract_code(good).startswith("def square")
    assert task.score(0, good) == 1.0
    assert task.score(0, "def square(x):\n    return x + x\n") == 0.0
    assert task.score(0, "def square(x):\n    while True: pass\n") == 0.0
    assert task.score(0, "\x00 binary junk") == 0.0
