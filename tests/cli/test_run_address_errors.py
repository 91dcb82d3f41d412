"""Issue 36, item 8: a malformed run address says which part is missing.

Before, ``join --run 'demo,/ip4/…/p2p/…'`` (the trainer left out) fell through as a run id and failed as
``bad node settings: : Value error, run id must be …``, and ``demo@`` named the empty string as "not an
address".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prime_node.cli.network_options import join_target
from prime_node.errors import NodeError
from protocol.errors import InvariantError
from protocol.run_announcement import RunAddress
from tests import warm_cli

CLI = [sys.executable, "-m", "prime_node"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_NODE_")}
TRAINER = "0x79B1B33BA04F20879BFfB5b089c6f3a3DE75E420"
PEER = "/ip4/127.0.0.1/tcp/4101/p2p/16Uiu2HAmC96wjLHZdAhNUyMPgf6SALDf4i6dvqpe9PnUiGKb3j7J"
FORM = "expected RUN@0xTRAINER[,BOOTSTRAP...]"


@pytest.mark.parametrize(
    ("text", "missing"),
    [
        ("demo", "trainer"),
        (f"demo,{PEER}", "trainer"),
        ("demo@", "trainer"),
        (f"demo@,{PEER}", "trainer"),
        (f"@{TRAINER}", "run id"),
        (f"demo@{TRAINER},", "bootstrap peer after a comma"),
        (f"demo@{TRAINER},,{PEER}", "bootstrap peer after a comma"),
    ],
)
def test_the_missing_part_is_named(text: str, missing: str) -> None:
    with pytest.raises(InvariantError) as caught:
        RunAddress.parse(text)
    assert caught.value.reason == "bad_run_address"
    assert str(caught.value) == f"run address {text[:80]!r} has no {missing}: {FORM}"


def test_a_bad_part_is_named() -> None:
    with pytest.raises(InvariantError, match=r"its run id 'Demo' must be 1-64"):
        RunAddress.parse(f"Demo@{TRAINER}")
    with pytest.raises(InvariantError, match=r"'demo@0x1234': trainer: not an address"):
        RunAddress.parse("demo@0x1234")


@given(st.text(alphabet=st.characters(blacklist_characters="@"), max_size=100))
def test_text_without_an_at_sign_is_a_run_address_without_a_trainer(text: str) -> None:
    with pytest.raises(InvariantError, match="has no trainer: expected RUN@0xTRAINER"):
        RunAddress.parse(text)


@pytest.mark.parametrize(
    ("run", "fragment"),
    [
        (f"demo,{PEER}", "--run: run address 'demo,/ip4/127.0.0.1/tcp/4101/p2p/16Uiu2HAm"),
        (f"demo,{PEER}", f"has no trainer: {FORM}"),
        ("Demo!", "--run 'Demo!' is neither a run id (it must be 1-64"),
    ],
)
def test_join_target_names_the_missing_trainer(run: str, fragment: str) -> None:
    with pytest.raises(NodeError) as caught:
        join_target(run, None)
    assert fragment in str(caught.value) and caught.value.reason == "bad_config"


def test_join_with_a_run_address_without_its_trainer_says_so(tmp_path: Path) -> None:
    result = warm_cli.run(
        [
            *CLI,
            "join",
            "--data-dir",
            str(tmp_path),
            "--new-wallet",
            "--no-password",
            "--light-kdf",
            "--run",
            f"demo,{PEER}",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "has no trainer" in line and FORM in line and "Value error" not in line and ": :" not in line
    assert not (tmp_path / "node.json").exists()
