"""The demo's plan: wallets known up front, a run config the normal loader accepts, the command lines."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prime_node.config import load_run_config
from prime_node.demo.setup import (
    DemoPlan,
    create_wallets,
    demo_run_config,
    joiner_command,
    toml_text,
    trainer_command,
    write_run_config,
)
from prime_node.errors import NodeError
from prime_node.wallet_store import keystore_file_address, unlock_keystore


def _plan(tmp_path: Path, *, adversary: str | None = "forged_proof") -> DemoPlan:
    nodes = create_wallets(tmp_path, inferers=2, validators=2, adversary=adversary)
    return DemoPlan(tmp_path, tuple(nodes), steps=40, model_dir=tmp_path / "model")


def test_every_node_gets_its_own_unlockable_wallet_without_password(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    assert [n.name for n in plan.nodes] == [
        "trainer", "validator-1", "validator-2", "inferer-1", "inferer-2", "adversary"
    ]  # fmt: skip
    assert len({n.address for n in plan.nodes}) == len(plan.nodes)
    for node in plan.nodes:
        assert str(keystore_file_address(node.keystore)) == node.address
        assert str(unlock_keystore(node.keystore, "").address) == node.address
    assert plan.adversary is not None and plan.adversary.adversary == "forged_proof"
    assert _plan(tmp_path / "honest", adversary=None).adversary is None


def test_the_run_config_names_the_trainer_and_trusts_exactly_the_validators(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    run = load_run_config(write_run_config(plan), environ={})
    assert run.trainer_address == plan.trainer.address
    assert set(run.trusted_validators) == {n.address for n in plan.of_role("validator")}
    assert plan.adversary is not None and plan.adversary.address not in run.trusted_validators
    assert run.max_steps == 40 and run.model_dir == tmp_path / "model"
    assert run.task.kind == "arithmetic" and run.task.reverse_answer
    assert run.eval_every == 10 and run.threads == 1


def test_fields_the_installed_config_lacks_are_left_out() -> None:
    data = demo_run_config(
        model_dir=Path("m"),
        output_dir=Path("o"),
        trainer_address="0x" + "11" * 20,
        validator_addresses=["0x" + "22" * 20],
        steps=5,
        supported={"run_id": None, "max_steps": None, "task": None},
    )
    assert set(data) == {"run_id", "max_steps", "task"}


def test_the_commands_use_the_planned_wallets_loopback_and_the_pinned_trainer(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    trainer = trainer_command(plan)
    assert trainer[trainer.index("--config") + 1] == str(plan.run_config_path)
    assert trainer[trainer.index("--keystore") + 1] == str(plan.trainer.keystore)
    assert "--no-password" in trainer and "/ip4/127.0.0.1/tcp/0" in trainer
    boot = "/ip4/127.0.0.1/tcp/4001/p2p/16Uiu2HAmDfv66QNaobLxD21FcCf4oGVCDEnnB9Q5JyHR1eYnUHco"
    for node in plan.nodes[1:]:
        command = joiner_command(plan, node, boot)
        assert command[command.index("--bootstrap") + 1] == boot
        assert command[command.index("--trainer") + 1] == plan.trainer.address
        assert command[command.index("--keystore") + 1] == str(node.keystore)
        expected_role = "inferer" if node.role == "adversary" else node.role
        assert command[command.index("--role") + 1] == expected_role
        assert ("--adversary" in command) == (node.role == "adversary")
        assert command[command.index("--threads") + 1] == "1"  # the demo's processes share its cores


_scalars = st.one_of(
    st.booleans(),
    st.integers(-(1 << 63), (1 << 63) - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
_keys = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True)


@given(
    st.dictionaries(_keys, st.one_of(_scalars, st.lists(_scalars, max_size=4)), max_size=6),
    st.dictionaries(_keys, _scalars, max_size=4),
)
def test_toml_text_round_trips_through_tomllib(flat: dict[str, object], table: dict[str, object]) -> None:
    data = {**flat, "zz_table": table} if "zz_table" not in flat else flat
    assert tomllib.loads(toml_text(data)) == data


def test_toml_text_refuses_what_it_cannot_write() -> None:
    with pytest.raises(NodeError):
        toml_text({"x": object()})
