"""Manifest file names a peer on any operating system can write: Windows device names are refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import InvariantError
from protocol.manifest import check_relative_path
from tests.strategies.swarm import relative_paths

DEVICES = ["CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(10)), *(f"LPT{i}" for i in range(10))]


@given(st.sampled_from(DEVICES), st.sampled_from(["", ".txt", ".json.bin"]), st.booleans(), st.booleans())
def test_windows_device_names_are_refused_in_any_case_with_any_extension_at_any_depth(
    device: str, extension: str, lower: bool, nested: bool
) -> None:
    name = (device.lower() if lower else device) + extension
    with pytest.raises(InvariantError, match="reserved device name"):
        check_relative_path(f"model/{name}" if nested else name)


@pytest.mark.parametrize("path", ["weights.", "dir./model.bin"])
def test_a_component_ending_with_a_dot_is_refused(path: str) -> None:
    with pytest.raises(InvariantError, match=r"ends with '\.'"):
        check_relative_path(path)


@pytest.mark.parametrize(
    "path", ["console.json", "COM10", "nulls/model.safetensors", "AUXILIARY.bin", "con_fig.json"]
)
def test_names_that_only_resemble_devices_are_accepted(path: str) -> None:
    check_relative_path(path)


@given(relative_paths)
def test_every_path_the_swarm_strategies_draw_is_accepted(path: str) -> None:
    check_relative_path(path)
