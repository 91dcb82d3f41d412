"""Run a ``prime-node`` command in the test's own process, through the console script's ``run_command`` (its
error handling and exit status), with stdout and stderr captured by pytest's ``capsys``.

For tests of what a command does rather than of the process around it, in test modules that have loaded
torch already: a fresh ``python -m prime_node`` spends several CPU-seconds importing torch before the
command starts. Every command keeps at least one test that runs it as a real process.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``prime-node ARGS`` as ``subprocess.run`` would report it: exit status, stdout, stderr."""
    from prime_node.cli.main import run_command

    capsys.readouterr()  # what the test printed before is not the command's
    argv = sys.argv
    sys.argv = ["prime-node", *args]
    try:
        run_command()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["prime-node", *args], code, out, err)
