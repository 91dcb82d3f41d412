"""A warm child lives in the server's namespaces: a request from another network namespace starts cold."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from prime_node.warm_start.server import namespace_reason


def test_a_process_in_our_namespaces_may_start_warm() -> None:
    assert namespace_reason(os.getpid()) is None


def test_a_process_in_another_network_namespace_starts_cold() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to make a network namespace")
    other = subprocess.Popen(["unshare", "--net", "sleep", "60"])
    try:
        for _ in range(200):  # until unshare has moved into its namespace and exec'd sleep
            with open(f"/proc/{other.pid}/comm") as comm:
                if comm.read().strip() == "sleep":
                    break
            time.sleep(0.05)
        reason = namespace_reason(other.pid)
        assert reason is not None and "net" in reason
    finally:
        other.kill()
        other.wait()
    assert namespace_reason(other.pid) is not None  # gone: its namespaces cannot be read
