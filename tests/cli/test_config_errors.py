"""Issue 36, item 8: a run config's problems are all named at once, in the project's words.

Before, a config with two typos reported one, in pydantic's phrasing ("Extra inputs are not permitted"),
with no hint of the field meant: the operator fixed it, restarted, and met the next.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, ValidationError

from prime_node.config import RunConfig, TaskConfig, load_run_config
from prime_node.config.problems import describe_problems
from prime_node.config.run import validate_run_config
from prime_node.errors import NodeError
from tests import warm_cli

CLI = [sys.executable, "-m", "prime_node"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_NODE_")}
PYDANTIC_WORDS = ("Input should", "Extra inputs", "Field required", "Value error", "validation error")


def _problem(tmp_path: Path, toml: str, environ: dict[str, str] | None = None) -> str:
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(NodeError) as caught:
        load_run_config(path, environ=environ or {})
    assert caught.value.reason == "bad_config"
    message = str(caught.value)
    assert "\n" not in message and not any(words in message for words in PYDANTIC_WORDS), message
    return message


def test_two_typos_are_both_named_each_with_the_field_meant(tmp_path: Path) -> None:
    message = _problem(tmp_path, 'grup_size = 4\nmax_step = 10\n[task]\nknd = "arithmetic"\n')
    assert message.startswith(f"{tmp_path / 'run.toml'}: 3 problems: ")
    assert "unknown field grup_size (did you mean group_size?)" in message
    assert "unknown field max_step (did you mean max_steps?)" in message
    assert "unknown field task.knd (did you mean task.kind?)" in message


def test_a_key_in_the_wrong_section_is_pointed_to_its_section(tmp_path: Path) -> None:
    message = _problem(tmp_path, "digits = 3\n[task]\nmax_steps = 5\n")
    assert "unknown field digits (did you mean task.digits, under [task]?)" in message
    assert (
        "unknown field task.max_steps (did you mean max_steps, at the top, before any [section]?)" in message
    )


def test_a_key_like_nothing_gets_no_guess(tmp_path: Path) -> None:
    message = _problem(tmp_path, "zzzzqqq = 1\n")
    assert message.endswith("run.toml: unknown field zzzzqqq")


def test_every_bad_value_is_listed_with_what_it_must_be(tmp_path: Path) -> None:
    message = _problem(
        tmp_path,
        'group_size = 1\nobjective = "vtrace"\ntrusted_validators = ["0x12"]\ncheckpoint_every = 0\n'
        'max_steps = "many"\n',
    )
    assert "5 problems" in message
    assert "field group_size: must be at least 2 (got 1)" in message
    assert (
        "field objective: must be 'recompute', 'behaviour', 'decoupled' or 'masked_is' (got 'vtrace')"
        in message
    )
    assert (
        "field trusted_validators[0]: must be an Ethereum address: 0x and 40 hex digits (got '0x12')"
        in message
    )
    assert "field checkpoint_every: must be at least 1 or 'auto' (got 0)" in message
    assert "field max_steps: must be a whole number (got 'many')" in message


def test_unknown_keys_come_first_and_an_environment_variable_is_named(tmp_path: Path) -> None:
    message = _problem(
        tmp_path,
        "group_size = 1\n",
        environ={"PRIME_NODE_RUN__TASK__DIGIT": "3", "PRIME_NODE_RUN__MAX_STEPS": "x"},
    )
    unknown = "unknown field task.digit (from PRIME_NODE_RUN__TASK__DIGIT; did you mean task.digits?)"
    assert message.index(unknown) < message.index("field group_size")
    assert "field max_steps: must be a whole number (got 'x') [from PRIME_NODE_RUN__MAX_STEPS]" in message


class _Needs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    size: int
    colour: str = "red"


def test_missing_required_fields_are_listed_together() -> None:
    with pytest.raises(ValidationError) as caught:
        _Needs.model_validate({"colur": "blue"})
    problems = describe_problems(caught.value, model=_Needs)
    assert problems.shown == (
        "unknown field colur (did you mean colour?)",
        "missing required fields name, size",
    )
    assert problems.total == 2


def test_a_config_with_thousands_of_bad_keys_gives_a_short_line() -> None:
    """An announced config comes from the network: its keys are quoted, cut and counted, not all listed."""
    data: dict[str, object] = {"evil\n\x1b[31mkey": 1, "x" * 5000: 1}
    data.update({f"knob_{i}": i for i in range(2000)})
    with pytest.raises(NodeError) as caught:
        validate_run_config(data, source="announced config")
    message = str(caught.value)
    assert message.startswith("announced config: 2002 problems: ") and message.endswith("and 1990 more")
    assert len(message) < 4000 and message.isprintable()
    assert "unknown field 'evil\\n\\x1b[31mkey'" in message and "'xxxxxxxx" in message


def _fields_of(model: type[BaseModel], section: str) -> list[tuple[str, str]]:
    return [(section, name) for name in model.model_fields if len(name) >= 3]


FIELDS = _fields_of(RunConfig, "") + _fields_of(TaskConfig, "task")


@st.composite
def _typo(draw: st.DrawFn, field: tuple[str, str]) -> tuple[str, str, str]:
    """A field's name with one character dropped or two neighbours swapped (never another field)."""
    section, name = field
    at = draw(st.integers(0, len(name) - 2))
    if draw(st.booleans()):
        typo = name[:at] + name[at + 1 :]
    else:
        typo = name[:at] + name[at + 1] + name[at] + name[at + 2 :]
    known = (TaskConfig if section else RunConfig).model_fields
    return section, name, typo if typo not in known else typo + "_x"


@given(
    st.lists(st.sampled_from(FIELDS), min_size=2, max_size=2, unique=True).flatmap(
        lambda pair: st.tuples(_typo(pair[0]), _typo(pair[1]))
    )
)
def test_any_two_typos_are_both_named_with_a_suggestion(typos: tuple[tuple[str, str, str], ...]) -> None:
    data: dict[str, object] = {}
    for section, _, typo in typos:
        (data.setdefault("task", {}) if section else data)[typo] = 1  # type: ignore[index]
    with pytest.raises(ValidationError) as caught:
        RunConfig.model_validate(data)
    text = "; ".join(describe_problems(caught.value, model=RunConfig).shown)
    for section, name, typo in typos:
        where = f"{section}." if section else ""
        assert f"unknown field {where}{typo} (" in text, text
        if typo != name and not typo.endswith("_x"):
            assert f"did you mean {where}{name}?" in text, text


def test_run_trainer_names_both_typos_as_a_process_would(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('grup_size = 4\n[task]\nknd = "arithmetic"\n')
    result = warm_cli.run(
        [*CLI, "run-trainer", "--config", str(config), "--local"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "grup_size (did you mean group_size?)" in line and "task.knd (did you mean task.kind?)" in line
