"""Issue 36, item 8: ``prime-node new-run DIR`` makes a run directory a person can start from.

Before it, setting up a networked run was a puzzle of order: examples/run.toml had no
``trusted_validators``, the trainer refuses to start without one, and no doc said to make the validator's
wallet first. These tests run the command as a person would and check what it prints is exact: the
trainer's config loads through the real loader, its validator is trusted, the model is where the config
says, the run address in the join commands is the one the trainer will print, and (slow) the printed
commands, started in order, train a step.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from crypto.identity import peer_id_from_public_key
from prime_node.config import load_run_config
from prime_node.wallet_store import unlock_keystore
from prime_node.warm_start.process import WarmProcess
from protocol.run_announcement import RunAddress
from tests import warm_cli
from tests.cli_in_process import run_cli

CLI = [sys.executable, "-m", "prime_node"]
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("PRIME_NODE_")},
    "PRIME_NODE_LOG_LEVEL": "warning",
}


def _three_free_ports() -> int:
    """A port P with P, P+1 and P+2 free on 127.0.0.1 (new-run gives the roles consecutive ports)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port > 65000:
            continue
        try:
            for offset in range(3):
                with socket.socket() as taken:
                    taken.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port
    raise AssertionError("no three consecutive free ports")


def _printed_commands(stdout: str) -> dict[str, tuple[Path, list[str]]]:
    """The numbered ``cd DIR && prime-node …`` lines, by role, as (directory, argv after prime-node)."""
    commands: dict[str, tuple[Path, list[str]]] = {}
    lines = stdout.splitlines()
    for heading, line in itertools.pairwise(lines):
        if heading[:1].isdigit() and line.strip().startswith("cd "):
            argv = shlex.split(line)
            assert argv[2] == "&&" and argv[3] == "prime-node", line
            role = heading.split(". ", 1)[1].split(":", 1)[0]
            commands[role] = (Path(argv[1]), argv[4:])
    return commands


def _option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_new_run_makes_a_run_whose_printed_commands_are_exact(tmp_path: Path) -> None:
    run_dir = tmp_path / "myrun"
    result = warm_cli.run(
        [*CLI, "new-run", str(run_dir), "--no-password", "--light-kdf", "--port", "4301", "--run-id", "sums"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    commands = _printed_commands(result.stdout)
    assert list(commands) == ["trainer", "validator", "inferer"]  # the order they must start in

    where, trainer_argv = commands["trainer"]
    assert where == run_dir.resolve() and trainer_argv[0] == "run-trainer"
    # The trainer's config, as the printed command names it, through the real loader.
    config = load_run_config(where / _option(trainer_argv, "--config"), environ={})
    trainer_key = unlock_keystore(where / _option(trainer_argv, "--keystore"), "")
    assert config.run_id == "sums" and config.trainer_address == str(trainer_key.address)
    assert config.model_dir is not None and (where / config.model_dir / "config.json").is_file()
    assert "--no-password" in trainer_argv and _option(trainer_argv, "--listen") == "/ip4/127.0.0.1/tcp/4301"

    _, validator_argv = commands["validator"]
    assert validator_argv[:3] == ["join", "--role", "validator"]
    validator_key = unlock_keystore(where / _option(validator_argv, "--keystore"), "")
    assert str(validator_key.address) in config.trusted_validators

    # Both joiners get the run address the trainer will print: its key, its listen address, its peer id.
    expected = RunAddress(
        "sums",
        trainer_key.address,
        (f"/ip4/127.0.0.1/tcp/4301/p2p/{peer_id_from_public_key(trainer_key.public_key)}",),
    )
    _, inferer_argv = commands["inferer"]
    for argv in (validator_argv, inferer_argv):
        assert RunAddress.parse(_option(argv, "--run")) == expected
    assert "--new-wallet" in inferer_argv and "--light-kdf" in inferer_argv
    listens = {_option(argv, "--listen") for _, argv in commands.values()}
    assert len(listens) == 3  # one machine: no two roles on one port
    assert f"run address  {expected}" in result.stdout


def test_new_run_json_has_the_same_commands_and_carries_the_password_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "password.txt"
    secret.write_text("correct horse\n")
    result = run_cli(
        capsys, "new-run", str(tmp_path / "run"), "--password-file", str(secret), "--light-kdf", "--json"
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    roles = [command["role"] for command in document["commands"]]
    assert roles == ["trainer", "validator", "inferer"]
    for command in document["commands"]:
        assert command["argv"][0] == "prime-node"
        assert _option(command["argv"], "--password-file") == str(secret.resolve())
    trainer = document["commands"][0]
    key = unlock_keystore(Path(trainer["cwd"]) / _option(trainer["argv"], "--keystore"), "correct horse")
    assert str(key.address) == document["trainer"]
    config = load_run_config(Path(document["config"]), environ={})
    assert list(config.trusted_validators) == document["trusted_validators"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--host", "0.0.0.0"], "cannot be dialled"),
        (["--host", "example.org"], "not an IPv4 address"),
        (["--run-id", "Has Spaces"], "--run-id"),
    ],
)
def test_new_run_refuses_bad_flags_before_writing_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], fragment: str
) -> None:
    result = run_cli(capsys, "new-run", str(tmp_path / "run"), "--no-password", *args)
    assert result.returncode == 1 and fragment in result.stderr and result.stderr.startswith("error:")
    assert not (tmp_path / "run").exists()


def test_new_run_never_writes_into_a_directory_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "keystore.json").write_text("{}")
    result = run_cli(capsys, "new-run", str(tmp_path), "--no-password")
    assert result.returncode == 1 and "not an empty directory" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keystore.json"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_printed_commands_started_in_order_train(tmp_path: Path) -> None:
    """End to end: new-run, then exactly its three commands (the trainer with --max-steps and
    --exit-when-done added, so it ends): the trainer's `join` line is new-run's run address and the run
    trains on batches its trusted validator accepted."""
    port = _three_free_ports()
    run_dir = tmp_path / "run"
    made = warm_cli.run(
        [*CLI, "new-run", str(run_dir), "--no-password", "--light-kdf", "--port", str(port)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=True,
    )
    commands = _printed_commands(made.stdout)
    run_address = next(
        line.split()[-1] for line in made.stdout.splitlines() if line.startswith("run address")
    )
    where, trainer_argv = commands["trainer"]
    trainer = warm_cli.popen(
        [*CLI, *trainer_argv, "--max-steps", "2", "--exit-when-done"],
        cwd=where,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "trainer.err").open("w"),
        text=True,
        env=ENV,
    )
    joiners: list[subprocess.Popen[Any] | WarmProcess] = []
    try:
        assert trainer.stdout is not None
        lines = []
        for line in trainer.stdout:  # the trainer first: the joiners dial it
            lines.append(line)
            if line.startswith('{"join"'):
                assert json.loads(line)["join"] == run_address
                break
        else:
            raise AssertionError("".join(lines) + (tmp_path / "trainer.err").read_text())
        for role in ("validator", "inferer"):
            cwd, argv = commands[role]
            log = (tmp_path / f"{role}.log").open("w")
            joiners.append(
                warm_cli.popen(
                    [*CLI, *argv], cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True, env=ENV
                )
            )
        rest = trainer.stdout.read()
        assert trainer.wait(timeout=600) == 0, rest + (tmp_path / "trainer.err").read_text()  # hang guard
        steps = [json.loads(line) for line in rest.splitlines() if line.startswith('{"step"')]
        assert [step["step"] for step in steps] == [1, 2], rest
    finally:
        for process in (trainer, *joiners):
            if process.poll() is None:
                process.terminate()
        for process in (trainer, *joiners):
            process.wait(timeout=60)
