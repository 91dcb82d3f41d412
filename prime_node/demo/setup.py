"""What the demo starts, decided before anything runs: node names, wallets, the run config, command lines.

Every node's wallet is created here (light scrypt, empty password: throwaway keys on one machine), so the
trainer's address and the trusted validators are known before the run config is written and signed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prime_node.errors import NodeError

DemoRole = Literal["trainer", "validator", "inferer", "adversary"]
"""The kinds of process a demo starts (not protocol roles: "adversary" is a cheating inferer)."""
RUN_ID = "demo"
LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"
HEARTBEAT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class NodeSpec:
    """One process of the demo."""

    name: str
    role: DemoRole
    data_dir: Path
    address: str
    adversary: str | None = None

    @property
    def keystore(self) -> Path:
        return self.data_dir / "keystore.json"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "node.log"


@dataclass(frozen=True)
class DemoPlan:
    """The whole swarm: where it lives and who is in it (trainer first)."""

    workdir: Path
    nodes: tuple[NodeSpec, ...]
    steps: int
    model_dir: Path
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def run_config_path(self) -> Path:
        return self.workdir / "run.toml"

    @property
    def trainer(self) -> NodeSpec:
        return self.nodes[0]

    def of_role(self, role: DemoRole) -> list[NodeSpec]:
        return [node for node in self.nodes if node.role == role]

    @property
    def adversary(self) -> NodeSpec | None:
        found = self.of_role("adversary")
        return found[0] if found else None


def node_names(inferers: int, validators: int, adversary: str | None) -> list[tuple[str, DemoRole]]:
    names: list[tuple[str, DemoRole]] = [("trainer", "trainer")]
    names += [(f"validator-{i + 1}", "validator") for i in range(validators)]
    names += [(f"inferer-{i + 1}", "inferer") for i in range(inferers)]
    if adversary is not None:
        names.append(("adversary", "adversary"))
    return names


def create_wallets(workdir: Path, inferers: int, validators: int, adversary: str | None) -> list[NodeSpec]:
    """One keystore per node under ``workdir/nodes/<name>/`` (light KDF, no password)."""
    from crypto.keys import WalletKey
    from prime_node.wallet_store import LIGHT_SCRYPT, create_keystore

    nodes = []
    for name, role in node_names(inferers, validators, adversary):
        data_dir = workdir / "nodes" / name
        key = WalletKey.generate()
        spec = NodeSpec(name, role, data_dir, str(key.address), adversary if role == "adversary" else None)
        create_keystore(spec.keystore, key, "", scrypt=LIGHT_SCRYPT)
        nodes.append(spec)
    return nodes


def demo_run_config(
    *,
    model_dir: Path,
    output_dir: Path,
    trainer_address: str,
    validator_addresses: Sequence[str],
    steps: int,
    seed: int = 0,
    supported: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The run config of the demo as a TOML-ready dict. Fields the installed RunConfig does not know
    (``supported`` is its field table) are left out, so the demo runs against older and newer configs."""
    from prime_node.config.run import RunConfig

    fields = RunConfig.model_fields if supported is None else supported
    wanted: dict[str, Any] = {
        "run_id": RUN_ID,
        "model_dir": str(model_dir),
        "output_dir": str(output_dir),
        "trainer_address": trainer_address,
        "trusted_validators": list(validator_addresses),
        "verdict_quorum": 1,
        "group_size": 8,
        "prompts_per_step": 16,
        "max_new_tokens": 5,
        "temperature": 0.7,
        "max_steps": steps,
        "learning_rate": 5e-4,
        # A constant rate reaches the plateau by step ~75, then wanders +-0.08 around it; a cosine decay
        # settles it (docs/rl.md, *Learning-rate schedule*: 300-step end points 0.70-0.72 on 5 seeds).
        "lr_schedule": "cosine",
        "lr_min_ratio": 0.1,
        "async_level": 4,
        "objective": "behaviour",
        "seed": seed,
        "threads": 1,
        "eval_every": max(1, steps // 4),
        "eval_tasks": 1024,  # every held-out sum: a 200-task measurement alone has a standard error of ~0.034
        "task": {"kind": "arithmetic", "digits": 2, "reverse_answer": True},
    }
    return {key: value for key, value in wanted.items() if key in fields}


def toml_text(data: Mapping[str, Any]) -> str:
    """A flat TOML document (scalars, lists of scalars, one level of tables): all a run config needs."""
    scalars = [(k, v) for k, v in data.items() if not isinstance(v, Mapping)]
    tables = [(k, v) for k, v in data.items() if isinstance(v, Mapping)]
    lines = [f"{key} = {_toml_value(value)}" for key, value in scalars]
    for name, table in tables:
        lines += ["", f"[{name}]"] + [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise NodeError(f"cannot write {type(value).__name__} to TOML", reason="bad_config")


def _toml_string(text: str) -> str:
    """A TOML basic string: quote, backslash and control characters (DEL included) escaped."""
    escaped = json.dumps(text, ensure_ascii=False)[1:-1]  # JSON's escapes are all valid TOML escapes
    return '"' + escaped.replace("\x7f", "\\u007f") + '"'


def write_run_config(plan: DemoPlan) -> Path:
    """Write ``run.toml`` and load it back through the normal loader (so a bad field fails here)."""
    from prime_node.config import load_run_config

    data = demo_run_config(
        model_dir=plan.model_dir,
        output_dir=plan.trainer.data_dir / "output",
        trainer_address=plan.trainer.address,
        validator_addresses=[node.address for node in plan.of_role("validator")],
        steps=plan.steps,
        **plan.extra,
    )
    path = plan.run_config_path
    path.write_text(toml_text(data), encoding="utf-8")
    load_run_config(path, environ={})
    return path


def cli() -> list[str]:
    """How the demo starts ``prime-node``: this interpreter, so the children run the same install."""
    return [sys.executable, "-m", "prime_node"]


def _identity_flags(node: NodeSpec) -> list[str]:
    return [
        "--data-dir",
        str(node.data_dir),
        "--keystore",
        str(node.keystore),
        "--no-password",
        "--listen",
        LOOPBACK_LISTEN,
        "--heartbeat-interval",
        str(HEARTBEAT_INTERVAL_S),
    ]


def trainer_command(plan: DemoPlan) -> list[str]:
    return [
        *cli(),
        "run-trainer",
        "--config",
        str(plan.run_config_path),
        *_identity_flags(plan.trainer),
    ]


def joiner_command(plan: DemoPlan, node: NodeSpec, bootstrap: str) -> list[str]:
    role = "inferer" if node.role == "adversary" else node.role
    command = [
        *cli(),
        "join",
        *_identity_flags(node),
        "--bootstrap",
        bootstrap,
        "--run",
        RUN_ID,
        "--role",
        role,
        "--trainer",
        plan.trainer.address,
        "--threads",
        "1",  # every demo process shares the machine's cores (the run config gives the trainer 1 too)
    ]
    if node.adversary is not None:
        command += ["--adversary", node.adversary]
    return command
