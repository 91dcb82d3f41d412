"""The demo's summary and its end condition, computed from status documents in the shapes nodes publish."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from prime_node.demo.summary import finished, summarize, training_progress
from prime_node.demo.view import named_snapshots, render

TRAINER = "0x" + "aa" * 20
HONEST = "0x" + "bb" * 20
CHEAT = "0x" + "cc" * 20
VALIDATOR = "0x" + "dd" * 20
ROLES = {"trainer": "trainer", "validator-1": "validator", "inferer-1": "inferer", "adversary": "adversary"}
ADDRESSES = {"trainer": TRAINER, "validator-1": VALIDATOR, "inferer-1": HONEST, "adversary": CHEAT}


def _doc(address: str, **sections: Any) -> dict[str, Any]:
    return {"address": address, "connected_peers": 3, "sections": sections}


def _swarm(step: int = 40, held_out: list[list[float]] | None = None) -> dict[str, Any]:
    held = held_out if held_out is not None else [[0, 0.23], [20, 0.41], [40, 0.71]]
    return {
        "trainer": _doc(
            TRAINER.upper().replace("0X", "0x"),  # checksummed vs lower case must not matter
            training={
                "step": step,
                "reward_curve": [[1, 0.3], [step, 0.8]],
                "held_out": held,
                "batches_accepted": 42,
                "batches_rejected": {"no_verdict": 2, "stale_policy": 1},
                "accepted_by_worker": {HONEST: 42},
                "checkpoints_shared": 41,
            },
            checkpoints={"versions": [], "bytes_in": 0, "bytes_out": 9000, "peers": 3},
        ),
        "validator-1": _doc(
            VALIDATOR,
            validation={
                "validated": 60,
                "accepted": 45,
                "rejected": {"toploc_exponent_mismatch": 15},
                "backlog": 0,
                "mean_validate_s": 0.01,
            },
        ),
        "inferer-1": _doc(HONEST, rollouts={"produced": 45, "published": 45, "accepted": 45, "rejected": {}}),
        "adversary": _doc(
            CHEAT,
            rollouts={
                "produced": 15,
                "published": 15,
                "accepted": 0,
                "rejected": {"toploc_exponent_mismatch": 15},
            },
        ),
    }


def test_summary_reports_rewards_batches_and_the_adversary() -> None:
    summary = summarize(
        _swarm(),
        ROLES,
        addresses=ADDRESSES,
        adversary_address=CHEAT,
        adversary_kind="forged_proof",
        wall_s=123.456,
        processes=[{"name": "trainer", "pid": 1, "exit": 0}],
    )
    assert summary["reward_start"] == 0.23 and summary["reward_end"] == 0.71
    assert summary["steps"] == 40 and summary["checkpoints_shared"] == 41
    assert summary["batches_accepted"] == 42
    assert summary["batches_rejected"] == {"no_verdict": 2, "stale_policy": 1}
    assert summary["validation_rejected"] == {"toploc_exponent_mismatch": 15}
    assert summary["adversary_accepted"] == 0
    assert summary["adversary"] == {
        "kind": "forged_proof",
        "address": CHEAT,
        "published": 15,
        "rejected": {"toploc_exponent_mismatch": 15},
    }
    assert summary["accepted_by_worker"] == {"inferer-1": 42, "adversary": 0}
    assert summary["wall_s"] == 123.5
    assert summary["nodes"]["validator-1"]["validation"]["validated"] == 60
    assert summary["nodes"]["trainer"]["checkpoint_bytes_out"] == 9000


def test_an_accepted_adversary_batch_is_counted_whatever_the_address_case() -> None:
    swarm = _swarm()
    swarm["trainer"]["sections"]["training"]["accepted_by_worker"][CHEAT.upper().replace("0X", "0x")] = 2
    summary = summarize(swarm, ROLES, addresses=ADDRESSES, adversary_address=CHEAT)
    assert summary["adversary_accepted"] == 2


def test_nodes_that_never_answered_or_answered_oddly_still_give_a_summary() -> None:
    swarm: dict[str, Any] = {name: None for name in ROLES}
    swarm["trainer"] = {"sections": {"training": {"accepted_by_worker": [CHEAT], "held_out": [[1], "x"]}}}
    swarm["validator-1"] = {"sections": {"validation": {"error": "KeyError: x"}}}
    swarm["inferer-1"] = {"sections": {"rollouts": {"published": "many", "rejected": ["x"]}}}
    summary = summarize(swarm, ROLES, addresses=ADDRESSES, adversary_address=CHEAT)
    assert summary["reward_start"] is None and summary["steps"] == 0
    assert summary["adversary_accepted"] == 0
    assert summary["nodes"]["adversary"] == {
        "role": "adversary", "address": CHEAT, "answered": False, "connected_peers": 0
    }  # fmt: skip
    assert summary["nodes"]["inferer-1"]["rollouts"]["published"] == 0


def test_the_demo_ends_only_after_the_last_step_and_a_held_out_eval_at_it() -> None:
    assert not finished(None, 40)
    assert not finished(_swarm(step=39)["trainer"], 40)
    assert not finished(_swarm(step=40, held_out=[[0, 0.2], [30, 0.5]])["trainer"], 40)
    assert not finished(_swarm(step=40, held_out=[])["trainer"], 40)
    assert finished(_swarm(step=40)["trainer"], 40)
    assert training_progress(_swarm()["trainer"]) == (40, [(0, 0.23), (20, 0.41), (40, 0.71)])


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(st.sampled_from(sorted(ROLES)), _json))
def test_any_json_from_a_node_yields_a_summary_and_a_picture(raw: dict[str, Any]) -> None:
    snapshots = {name: raw.get(name) for name in ROLES}
    summary = summarize(snapshots, ROLES, addresses=ADDRESSES, adversary_address=CHEAT)
    assert isinstance(summary["adversary_accepted"], int)
    render(snapshots, ROLES, steps=10, elapsed_s=1.0, adversary="forged_proof")


def test_the_swarm_picture_names_every_node_and_marks_the_cheater() -> None:
    swarm: dict[str, Any] = _swarm()
    swarm["inferer-1"] = None
    rows = named_snapshots(swarm, ROLES)
    assert [row["name"] for row in rows] == ["trainer", "validator-1", "inferer-1", "adversary (cheats)"]
    assert rows[2] == {"name": "inferer-1", "role": "starting…"}


def test_summary_of_a_recorded_default_demo() -> None:
    """The status documents a real default demo left behind (tests/demo/data), summarized again."""
    import json
    from pathlib import Path

    recorded = json.loads((Path(__file__).parent / "data" / "default_demo_status.json").read_text())
    roles, addresses = recorded["roles"], recorded["addresses"]
    summary = summarize(
        recorded["snapshots"], roles, addresses=addresses, adversary_address=addresses["adversary"]
    )
    assert (summary["reward_start"], summary["reward_end"]) == (0.23, 0.82)
    assert summary["steps"] == 250 and summary["checkpoints_shared"] == 251
    assert summary["batches_accepted"] == 425 and summary["batches_rejected"] == {"stale": 382}
    assert summary["adversary_accepted"] == 0
    assert summary["adversary"]["rejected"] == {"toploc_exponent_mismatch": 4}
    assert summary["validation_rejected"] == {"stale_policy": 13, "toploc_exponent_mismatch": 4}
    assert summary["accepted_by_worker"] == {"inferer-1": 115, "inferer-2": 138, "adversary": 0}
    assert finished(recorded["snapshots"]["trainer"], 250)
    assert not finished(recorded["snapshots"]["trainer"], 251)
