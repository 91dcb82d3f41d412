"""``prime-node new-run DIR``: a run directory a person can start from, and the commands that start it.

Setting up a networked run by hand is a puzzle of order: the trainer refuses to start without trusted
validators, so the validator's wallet must exist before the run config can be written, and the run
address joiners need is only printed once the trainer runs. This command does it in that order: both
wallets, the packaged tiny model, a run.toml with ``trainer_address`` and ``trusted_validators`` filled
in (loaded back through the real loader), and the run address computed from the trainer key's peer id
and its listen address, so every printed command is exact before anything starts.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from prime_node.assets import copy_demo_model
from prime_node.cli.options import (
    JsonOption,
    LightKdfOption,
    NoPasswordOption,
    PasswordEnvOption,
    PasswordFileOption,
)
from prime_node.demo.setup import demo_run_config, toml_text
from prime_node.errors import NodeError

MODEL_SUBDIR = "model"
CONFIG_NAME = "run.toml"
TRAINER_SUBDIR = "trainer"
VALIDATOR_SUBDIR = "validator"
INFERER_SUBDIR = "inferer"
KEYSTORE_NAME = "keystore.json"


def register(app: typer.Typer) -> None:
    app.command("new-run")(new_run)


@dataclass(frozen=True)
class RoleCommand:
    """One process to start: what it is, why in this place of the order, and its command line (run from
    the run directory: the config's paths are relative to it)."""

    role: str
    why: str
    argv: tuple[str, ...]

    def shell(self, run_dir: Path) -> str:
        """The line to paste into a new terminal."""
        return f"cd {shlex.quote(str(run_dir))} && {shlex.join(self.argv)}"


def password_flags(password_file: Path | None, password_env: str | None, no_password: bool) -> list[str]:
    """The password option new-run was given, for the commands it prints (none: they prompt too)."""
    if no_password:
        return ["--no-password"]
    if password_file is not None:
        return ["--password-file", str(password_file.resolve())]
    if password_env is not None:
        return ["--password-env", password_env]
    return []


def listen_addr(host: str, port: int) -> str:
    return f"/ip4/{host}/tcp/{port}"


def role_commands(
    *, run_address: str, host: str, port: int, password: list[str], light_kdf: bool
) -> list[RoleCommand]:
    """The trainer, its trusted validator and one inferer, in the order they must start."""
    trainer = RoleCommand(
        "trainer",
        "holds the run's key, announces the run and trains; start the others once it has printed its "
        "`join` line (the run address above)",
        (
            "prime-node",
            "run-trainer",
            "--config",
            CONFIG_NAME,
            "--data-dir",
            TRAINER_SUBDIR,
            "--keystore",
            f"{TRAINER_SUBDIR}/{KEYSTORE_NAME}",
            *password,
            "--listen",
            listen_addr(host, port),
        ),
    )
    validator = RoleCommand(
        "validator",
        "run.toml trusts its address; the trainer trains only on batches a trusted validator accepted",
        (
            "prime-node",
            "join",
            "--role",
            "validator",
            "--run",
            run_address,
            "--data-dir",
            VALIDATOR_SUBDIR,
            "--keystore",
            f"{VALIDATOR_SUBDIR}/{KEYSTORE_NAME}",
            *password,
            "--listen",
            listen_addr(host, port + 1),
        ),
    )
    inferer = RoleCommand(
        "inferer",
        "generates rollouts; start as many as you like, each with its own --data-dir and port (on a home "
        "PC leave out --role: the node picks one from its hardware)",
        (
            "prime-node",
            "join",
            "--role",
            "inferer",
            "--run",
            run_address,
            "--data-dir",
            INFERER_SUBDIR,
            "--new-wallet",
            *(["--light-kdf"] if light_kdf else []),
            *password,
            "--listen",
            listen_addr(host, port + 2),
        ),
    )
    return [trainer, validator, inferer]


def run_config_text(data: dict[str, Any]) -> str:
    """run.toml: the identity fields with comments that say how to change them, then the recipe."""
    identity_keys = (
        "run_id",
        "model_dir",
        "output_dir",
        "trainer_address",
        "trusted_validators",
        "verdict_quorum",
    )
    identity = {key: data[key] for key in identity_keys if key in data}
    rest = {key: value for key, value in data.items() if key not in identity}
    lines = toml_text(identity).splitlines()
    comments = {
        "run_id": [
            "# Made by `prime-node new-run`. Every field: prime_node/config/run.py (and docs/rl.md).",
            "# Paths are relative to the directory the nodes are started from: this one.",
        ],
        "trainer_address": [
            f"# The trainer's wallet ({TRAINER_SUBDIR}/{KEYSTORE_NAME}): only it announces the run and signs "
            "checkpoints.",
        ],
        "trusted_validators": [
            "# Validators whose signed verdicts the trainer counts (a networked trainer refuses to start",
            f"# with none): here {VALIDATOR_SUBDIR}/{KEYSTORE_NAME}'s address. To trust another validator,",
            "# make its wallet first (`prime-node wallet new --keystore …`), then add the address it prints.",
        ],
    }
    out: list[str] = []
    for line in lines:
        key = line.split(" = ", 1)[0]
        out += [*comments.get(key, []), line]
    return "\n".join(out) + "\n\n" + toml_text(rest)


def new_run(
    run_dir: Annotated[
        Path,
        typer.Argument(
            help="Directory to create (or an empty one): wallets, model, run.toml.", file_okay=False
        ),
    ],
    run_id: Annotated[str, typer.Option("--run-id", help="Name of the run.")] = "demo",
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="IPv4 address the trainer listens on and the others dial: 127.0.0.1 for one machine, this "
            "machine's LAN or public address for others. The printed validator and inferer commands listen "
            "on it too; on another machine give them that machine's address.",
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(
            "--port",
            min=1,
            max=65533,
            help="The trainer's port; the validator and inferer take the next two.",
        ),
    ] = 4101,
    steps: Annotated[int, typer.Option("--steps", min=1, help="max_steps of the run.")] = 300,
    seed: Annotated[
        int, typer.Option("--seed", min=0, help="Seed of the run's task schedule and sampling.")
    ] = 0,
    password_file: PasswordFileOption = None,
    password_env: PasswordEnvOption = None,
    no_password: NoPasswordOption = False,
    light_kdf: LightKdfOption = False,
    as_json: JsonOption = False,
) -> None:
    """Create a run directory to start from: a trainer wallet and a validator wallet, the demo's tiny
    model, a run.toml naming the trainer and trusting the validator, and print the commands that start the
    trainer, the validator and an inferer, in that order (both wallets share one password)."""
    from crypto.identity import peer_id_from_public_key
    from crypto.keys import WalletKey
    from prime_node.config import load_run_config
    from prime_node.wallet_store import LIGHT_SCRYPT, PasswordSource, create_keystore
    from protocol.names import NAME_RULE, is_valid_name
    from protocol.run_announcement import RunAddress

    if not is_valid_name(run_id):
        raise NodeError(f"--run-id {run_id[:60]!r} {NAME_RULE}", reason="bad_flag")
    try:
        dialable = ipaddress.IPv4Address(host)
    except ValueError:
        raise NodeError(f"--host {host[:60]!r} is not an IPv4 address", reason="bad_flag") from None
    if dialable.is_unspecified:
        raise NodeError(
            "--host 0.0.0.0 cannot be dialled: give the address the other nodes reach this machine at",
            reason="bad_flag",
        )
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise NodeError(f"{run_dir} exists and is not an empty directory", reason="exists")
    password = PasswordSource(password_file, password_env, no_password).resolve(confirm=True)

    keys = {TRAINER_SUBDIR: WalletKey.generate(), VALIDATOR_SUBDIR: WalletKey.generate()}
    for name, key in keys.items():
        keystore = run_dir / name / KEYSTORE_NAME
        if light_kdf:
            create_keystore(keystore, key, password, scrypt=LIGHT_SCRYPT)
        else:
            create_keystore(keystore, key, password)
    trainer, validator = keys[TRAINER_SUBDIR], keys[VALIDATOR_SUBDIR]
    model = copy_demo_model(run_dir / MODEL_SUBDIR)
    data = {
        **demo_run_config(
            model_dir=Path(MODEL_SUBDIR),
            output_dir=Path(TRAINER_SUBDIR) / "output",
            trainer_address=str(trainer.address),
            validator_addresses=[str(validator.address)],
            steps=steps,
            seed=seed,
        ),
        "run_id": run_id,
    }
    config_path = run_dir / CONFIG_NAME
    config_path.write_text(run_config_text(data), encoding="utf-8")
    load_run_config(config_path, environ={})  # what the trainer will read; a bad field fails here
    trainer_peer = f"{listen_addr(host, port)}/p2p/{peer_id_from_public_key(trainer.public_key)}"
    run_address = str(RunAddress(run_id, trainer.address, (trainer_peer,)))
    commands = role_commands(
        run_address=run_address,
        host=host,
        port=port,
        password=password_flags(password_file, password_env, no_password),
        light_kdf=light_kdf,
    )
    absolute = run_dir.resolve()
    parameters = int(model["parameters"])
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "run_dir": str(absolute),
                    "config": str(absolute / CONFIG_NAME),
                    "model_dir": str(absolute / MODEL_SUBDIR),
                    "trainer": str(trainer.address),
                    "trusted_validators": [str(validator.address)],
                    "run_address": run_address,
                    "commands": [
                        {"role": c.role, "cwd": str(absolute), "argv": list(c.argv)} for c in commands
                    ],
                }
            )
        )
        return
    typer.echo(
        "\n".join(
            [
                f"created run {run_id} in {absolute}",
                f"  trainer    {trainer.address}  {TRAINER_SUBDIR}/{KEYSTORE_NAME}",
                f"  validator  {validator.address}  {VALIDATOR_SUBDIR}/{KEYSTORE_NAME} (trusted by run.toml)",
                f"  model      {MODEL_SUBDIR}/  the demo's tiny arithmetic model, {parameters:,} parameters",
                f"  config     {CONFIG_NAME}  {steps} steps",
                f"run address  {run_address}",
                "",
                "Start each in its own terminal, in this order:",
            ]
        )
    )
    for number, command in enumerate(commands, 1):
        typer.echo(f"{number}. {command.role}: {command.why}\n   {command.shell(absolute)}")
    typer.echo(
        "\n".join(
            [
                "",
                f"Watch:  prime-node status --data-dir {shlex.quote(str(absolute / TRAINER_SUBDIR))}",
                f"Alone, no network:  cd {shlex.quote(str(absolute))} && prime-node run-trainer --config "
                f"{CONFIG_NAME} --local",
            ]
        )
    )
