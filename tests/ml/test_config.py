from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prime_node.config import RunConfig, load_run_config
from prime_node.errors import NodeError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIGS = sorted((REPO / "examples").glob("*.toml"))


def test_there_are_example_run_configs() -> None:
    assert any(path.name == "run.toml" for path in EXAMPLE_CONFIGS)


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=[p.name for p in EXAMPLE_CONFIGS])
def test_every_example_config_loads(path: Path) -> None:
    config = load_run_config(path, environ={})
    assert config.run_id and config.async_level >= 0


def test_every_field_is_documented() -> None:
    def undocumented(model: type) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():  # type: ignore[attr-defined]
            if not field.description:
                missing.append(name)
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                missing += [f"{name}.{sub}" for sub in undocumented(annotation)]
        return missing

    assert undocumented(RunConfig) == []


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ("eps_low = 1.5\n", "eps_low"),
        ("group_size = 1\n", "group_size"),
        ('[task]\nkind = "poetry"\n', "task.kind"),
        ('[task]\nkind = "math"\n', "task"),
        ("unknown_knob = 3\n", "unknown_knob"),
        ('trainer_address = "0x12"\n', "trainer_address"),
        ('run_id = "Has Spaces"\n', "run_id"),
        ('objective = "vtrace"\n', "objective"),
        ("is_cap = 0.5\n", "is_cap"),
        ("is_mask_low = 1.5\n", "is_mask_low"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_field(tmp_path: Path, toml: str, field: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(NodeError) as info:
        load_run_config(path, environ={})
    message = str(info.value)
    assert "\n" not in message and f"field {field}" in message and info.value.reason == "bad_config"


def test_not_toml_and_missing_file_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("this is = = not toml")
    with pytest.raises(NodeError, match="not valid TOML"):
        load_run_config(tmp_path / "bad.toml", environ={})
    with pytest.raises(NodeError, match="cannot read"):
        load_run_config(tmp_path / "missing.toml", environ={})


def test_environment_then_explicit_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("async_level = 1\n[task]\ndigits = 2\n")
    env = {"PRIME_NODE_RUN__ASYNC_LEVEL": "3", "PRIME_NODE_RUN__TASK__DIGITS": "4", "UNRELATED": "x"}
    config = load_run_config(path, environ=env, overrides={"async_level": 0})
    assert config.async_level == 0 and config.task.digits == 4
    with pytest.raises(NodeError, match="field group_size"):
        load_run_config(path, environ={"PRIME_NODE_RUN__GROUP_SIZE": "many"})


def test_config_imports_without_torch() -> None:
    code = "import sys, prime_node.config; assert not {'torch', 'transformers'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=[p.name for p in EXAMPLE_CONFIGS])
def test_every_example_task_can_be_built(path: Path) -> None:
    from prime_node.tasks.factory import build_task

    config = load_run_config(path, environ={})
    if config.task.path is not None and not config.task.path.is_absolute():
        config = config.model_copy(
            update={"task": config.task.model_copy(update={"path": REPO / config.task.path})}
        )
    task = build_task(config.task)
    assert len(task.train_ids()) > 0 and task.prompt(task.train_ids()[0])
