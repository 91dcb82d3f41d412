"""The run-id rule is defined once (protocol/names.py) and every layer that checks it agrees."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from prime_node.config.run import RunConfig
from prime_node.node_config import NodeConfig
from protocol.envelope import Domain
from protocol.errors import InvariantError, LocalProtocolError
from protocol.names import check_run_id, is_valid_name

GOOD = ["demo", "a", "run-1.v2_x", "0" * 64]
BAD = ["", "-demo", "Demo", "demo\n", "de mo", "0" * 65, "démo", ".x"]


@pytest.mark.parametrize("name", GOOD)
def test_every_layer_accepts_a_good_run_id(name: str) -> None:
    assert is_valid_name(name) and check_run_id(name) == name
    assert Domain("heartbeat", name).run == name
    assert NodeConfig(run_id=name).run_id == name
    assert RunConfig.model_validate({"run_id": name}).run_id == name


@pytest.mark.parametrize("name", BAD)
def test_every_layer_refuses_a_bad_run_id(name: str) -> None:
    assert not is_valid_name(name)
    with pytest.raises(InvariantError) as caught:
        check_run_id(name)
    assert caught.value.reason == "bad_run_id"
    with pytest.raises(LocalProtocolError):
        Domain("heartbeat", name)
    with pytest.raises(ValidationError):
        NodeConfig(run_id=name)
    with pytest.raises(ValidationError):
        RunConfig.model_validate({"run_id": name})
