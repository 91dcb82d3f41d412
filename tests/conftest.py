"""Suite-wide settings. Hypothesis profiles: `dev` (default) is quick; CI=true selects `ci`. Slow tests run
first."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from prime_node.warm_start.launcher import WarmStart, enabled

settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")
# Nodes, trainers and engines that tests run in one process share the machine's cores like the demo's
# processes do: one torch thread each unless the caller says otherwise (cpu_compute.default_threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# As the demo's children have them (demo/orchestrator.child_env), so that processes tests start with that
# environment are forked warm from the same server (prime_node/warm_start/compatibility.py).
for _name, _value in {
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked slow (whole processes, minutes each) first, each group in its usual order: the
    xdist workers (Makefile) then share the long ones out at the start and end on short ones together,
    instead of one worker finishing a 2-minute demo while the others wait."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", autouse=True)
def warm_start_server() -> Iterator[WarmStart | None]:
    """One warm-start server per test process (per xdist worker), named in the environment so that
    the processes prime-node starts itself (``--local``'s inference child) are forked from it too; tests
    start prime-node processes through ``tests/warm_cli.py``. Off with PRIME_NODE_WARM_START=0."""
    if not enabled():
        yield None
        return
    with WarmStart() as server:
        os.environ.update(server.child_env({}))
        try:
            yield server
        finally:
            for key in server.child_env({}):
                os.environ.pop(key, None)
