"""Suite-wide settings. Hypothesis profiles: `dev` (default) is quick; CI=true selects `ci`. Slow tests run
first."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")
# Nodes, trainers and engines that tests run in one process share the machine's cores like the demo's
# processes do: one torch thread each unless the caller says otherwise (hardware.default_threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked slow (whole processes, minutes each) first, each group in its usual order: the
    xdist workers (Makefile) then share the long ones out at the start and end on short ones together,
    instead of one worker finishing a 2-minute demo while the others wait."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
