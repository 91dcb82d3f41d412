"""``prime-node run-trainer --nproc 2`` over the network: rank 0 is the node, rank 1 only trains.

Real processes on 127.0.0.1, started as the demo starts them (its wallets, run config, command lines and
supervisor): the trainer under torchrun with gloo, one inferer and one validator. The trainer's stdout
carries rank 0's step lines, its stderr one line per step from rank 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prime_node.demo.orchestrator import child_env, read_node_file
from prime_node.demo.setup import (
    DemoPlan,
    create_wallets,
    demo_run_config,
    joiner_command,
    toml_text,
    trainer_command,
)
from prime_node.demo.supervisor import Child, Supervisor
from tests import warm_cli

REPO = Path(__file__).resolve().parents[2]
SMALL_RUN = {
    "group_size": 4,
    "prompts_per_step": 4,
    "async_level": 2,
    "eval_tasks": 16,
    "eval_every": 0,
}


@pytest.fixture(scope="module")
def warm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's packaged warmed-up tiny model: sampled rewards differ within a group, so steps have
    informative groups to train on (random weights give none)."""
    from prime_node.assets import copy_demo_model

    out = tmp_path_factory.mktemp("warm") / "model"
    copy_demo_model(out)
    return out


def _plan(tmp_path: Path, model_dir: Path, *, steps: int) -> DemoPlan:
    """Wallets of a trainer, a validator and an inferer, and a small run config naming them."""
    nodes = create_wallets(tmp_path, inferers=1, validators=1, adversary=None)
    plan = DemoPlan(tmp_path, tuple(nodes), steps, model_dir)
    config = demo_run_config(
        model_dir=model_dir,
        output_dir=plan.trainer.data_dir / "output",
        trainer_address=plan.trainer.address,
        validator_addresses=[node.address for node in plan.of_role("validator")],
        steps=steps,
    )
    plan.run_config_path.write_text(toml_text({**config, **SMALL_RUN}), encoding="utf-8")
    return plan


def _lines(child: Child) -> list[dict[str, Any]]:
    """The JSON objects among the lines of a child's log (stdout and stderr)."""
    found = []
    for line in child.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
    return found


def _wait(what: str, condition: Callable[[], bool], child: Child, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert child.running(), f"the trainer exited while waiting for {what}:\n{child.log_tail(40)}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s:\n{child.log_tail(40)}"
        time.sleep(0.5)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _rank_pids(trainer: Child) -> dict[int, int]:
    """Rank -> pid: rank 0 from its node.json, the others from their first line."""
    pids = {line["rank"]: line["pid"] for line in _lines(trainer) if "pid" in line and "rank" in line}
    return pids


def _same_tensors(left: Path, right: Path) -> bool:
    from safetensors.torch import load_file

    a, b = load_file(str(left)), load_file(str(right))
    return set(a) <= set(b) and all(a[name].equal(b[name]) for name in a)


def _compare_held(store: Path, checkpoints: Path) -> int:
    """How many trained policies the inferer holds that it holds with the tensors of the trainer's
    checkpoint of that step (AssertionError on one that differs). Either side may prune a version
    meanwhile: those are skipped."""
    compared = 0
    for held in store.glob("step-*"):
        step = int(held.name.split("-")[1])
        if step < 1:
            continue
        try:
            assert _same_tensors(
                held / "model.safetensors", checkpoints / f"step_{step:08d}" / "model.safetensors"
            ), step
        except FileNotFoundError:
            continue
        compared += 1
    return compared


@pytest.mark.slow
def test_two_ranks_train_every_admitted_step_and_a_dead_rank_stops_the_node(
    tmp_path: Path, warm_model_dir: Path
) -> None:
    plan = _plan(tmp_path, warm_model_dir, steps=50)
    with Supervisor(child_env()) as supervisor:
        trainer = supervisor.start("trainer", [*trainer_command(plan), "--nproc", "2"], plan.trainer.log_path)
        _wait("node.json", lambda: read_node_file(plan.trainer) is not None, trainer, 180)
        node = read_node_file(plan.trainer)
        assert node is not None
        bootstrap = next(a for a in node["multiaddrs"] if "/p2p/" in a)
        for joiner in plan.nodes[1:]:
            supervisor.start(joiner.name, joiner_command(plan, joiner, bootstrap), joiner.log_path)

        def steps_of(rank: int) -> list[dict[str, Any]]:
            lines = _lines(trainer)
            if rank == 0:
                return [line for line in lines if "policy_step" in line and "rank" not in line]
            return [line for line in lines if line.get("rank") == rank and "step" in line]

        def both_took(count: int) -> bool:
            taken = {line["step"] for line in steps_of(1)}
            done = [line["step"] for line in steps_of(0)]
            return len(done) >= count and taken >= set(done)

        _wait("3 steps on both ranks", lambda: both_took(3), trainer, 300)
        # Both ranks took every step, in order, on the same batch (policy step, groups, reward: what
        # rank 0 admitted and broadcast) and through the same collectives (the gradient norm is
        # reduced over both ranks' shards; rank 0 prints it rounded to 4 decimals, loss to 5).
        rank0 = steps_of(0)
        rank1 = {line["step"]: line for line in steps_of(1)}
        assert [line["step"] for line in rank0] == list(range(1, len(rank0) + 1))
        assert sorted(rank1) == list(range(1, len(rank1) + 1))
        for mine in rank0:
            line = rank1[mine["step"]]
            assert (line["policy_step"], line["groups_kept"]) == (mine["policy_step"], mine["groups_kept"])
            assert line["reward"] == pytest.approx(mine["reward"], abs=1e-4)
            assert line["grad_norm"] == pytest.approx(mine["grad_norm"], rel=1e-5, abs=1e-4)
            assert line["loss"] == pytest.approx(mine["loss"], rel=1e-5, abs=1e-5)
        # What the inferer loaded through the weight swarm is what the ranks trained: each policy it
        # holds has the tensors of the trainer's checkpoint of that step.
        inferer = plan.of_role("inferer")[0]
        store = inferer.data_dir / "swarm" / "checkpoints"
        _wait(
            "a trained policy at the inferer",
            lambda: any(int(d.name.split("-")[1]) >= 1 for d in store.glob("step-*")),
            trainer,
            120,
        )
        checkpoints = plan.trainer.data_dir / "output" / "checkpoints"
        _wait("a policy held by both", lambda: _compare_held(store, checkpoints) >= 1, trainer, 120)
        # A rank dying stops the whole node with a clear error.
        pids = _rank_pids(trainer)
        pids[0] = node["pid"]
        assert set(pids) == {0, 1}
        os.kill(pids[1], signal.SIGKILL)
        trainer.process.wait(timeout=120)
        assert trainer.process.returncode == 1, trainer.log_tail(40)
        assert "error: torchrun exited with status 1: a trainer rank failed" in trainer.log_tail(40)
        deadline = time.monotonic() + 30
        while not all(_gone(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_gone(pid) for pid in pids.values())


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank(tmp_path: Path, warm_model_dir: Path) -> None:
    plan = _plan(tmp_path, warm_model_dir, steps=5)
    with Supervisor(child_env()) as supervisor:
        trainer = supervisor.start("trainer", [*trainer_command(plan), "--nproc", "2"], plan.trainer.log_path)
        _wait("rank 1", lambda: 1 in _rank_pids(trainer), trainer, 180)
        _wait("node.json", lambda: read_node_file(plan.trainer) is not None, trainer, 60)
        node = read_node_file(plan.trainer)
        assert node is not None
        pids = {0: int(node["pid"]), 1: _rank_pids(trainer)[1]}
        trainer.process.send_signal(signal.SIGTERM)
        trainer.process.wait(timeout=120)  # a guard against a hang: the exit status says how it stopped
        log = trainer.log_tail(60)
        assert trainer.process.returncode == 130, log
        assert "stopping every trainer rank" in log and "received SIGTERM, shutting down" in log
        assert all(_gone(pid) for pid in pids.values()), log


@pytest.mark.slow
def test_exit_when_done_ends_every_rank_together(tmp_path: Path, warm_model_dir: Path) -> None:
    """max_steps 0: rank 0 opens the session, shares policy 0, evaluates it and stops the node; its
    session.close() releases rank 1, and every process exits 0."""
    plan = _plan(tmp_path, warm_model_dir, steps=0)
    done = warm_cli.run(
        [*trainer_command(plan), "--nproc", "2", "--exit-when-done"],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert any("join" in line for line in out)
    assert [line["eval_step"] for line in out if "eval_step" in line] == [0]
    followers = [json.loads(line) for line in done.stderr.splitlines() if line.startswith('{"rank"')]
    assert followers == [{"rank": 1, "pid": followers[0]["pid"], "following_from_step": 0}]
    assert (plan.trainer.data_dir / "output" / "policies" / "step_00000000" / "model.safetensors").is_file()


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return warm_cli.run(
        [sys.executable, "-m", "prime_node", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_nproc_two_fails_before_torchrun_without_the_key_or_with_a_bad_config(
    tmp_path: Path, warm_model_dir: Path
) -> None:
    from crypto.keys import WalletKey
    from prime_node.wallet_store import LIGHT_SCRYPT, create_keystore

    trainer, other = WalletKey.generate(), WalletKey.generate()
    out = tmp_path / "out"
    config = tmp_path / "run.toml"
    config.write_text(
        f'run_id = "t"\nmodel_dir = "{warm_model_dir}"\noutput_dir = "{out}"\n'
        f'trainer_address = "{trainer.address}"\ntrusted_validators = ["{other.address}"]\n'
    )
    flags = ["--nproc", "2", "--data-dir", str(tmp_path / "node"), "--listen", "/ip4/127.0.0.1/tcp/0"]

    def refused(*args: str, env: dict[str, str] | None = None) -> str:
        done = _cli("run-trainer", *args, *flags, env=env)
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith("error:") and done.stderr.strip().count("\n") == 0, done.stderr
        assert "torch.distributed" not in done.stderr and not out.exists()  # nothing was started
        return done.stderr

    no_key = refused("--config", str(config))
    assert "no keystore" in no_key and "trainer key" in no_key
    wrong = tmp_path / "other.json"
    create_keystore(wrong, other, "", scrypt=LIGHT_SCRYPT)
    assert "not the run's trainer_address" in refused(
        "--config", str(config), "--keystore", str(wrong), "--no-password"
    )
    right = tmp_path / "trainer.json"
    create_keystore(right, trainer, "secret", scrypt=LIGHT_SCRYPT)
    password = ["--keystore", str(right), "--password-env", "TRAINER_PW"]
    assert "wrong password" in refused("--config", str(config), *password, env={"TRAINER_PW": "guess"})
    good = {"TRAINER_PW": "secret"}
    bad = tmp_path / "bad.toml"
    bad.write_text("eps_high = -1\n")
    assert "field eps_high" in refused("--config", str(bad), *password, env=good)
    unchecked = tmp_path / "unchecked.toml"
    unchecked.write_text(config.read_text().replace("trusted_validators", "# trusted_validators"))
    assert "no trusted_validators" in refused("--config", str(unchecked), *password, env=good)
    missing = tmp_path / "missing.toml"
    missing.write_text(config.read_text().replace(str(warm_model_dir), str(tmp_path / "nope")))
    assert "does not exist" in refused("--config", str(missing), *password, env=good)


def _ask_for_key(directory: Path) -> subprocess.CompletedProcess[str]:
    """A real process that asks for the key as rank 0 does (a child of this test process)."""
    code = (
        "import sys; from pathlib import Path; from prime_node.errors import NodeError\n"
        "from prime_node.roles.trainer_launcher import receive_key\n"
        "try:\n    print(receive_key(Path(sys.argv[1]), timeout=20).address)\n"
        "except NodeError as exc:\n    print('refused', exc.reason)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(directory)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_key_goes_only_to_a_child_of_the_torchrun_the_launcher_started(tmp_path: Path) -> None:
    from crypto.keys import WalletKey
    from prime_node.roles.trainer_launcher import KeyHandoff

    key = WalletKey.generate()
    stranger = KeyHandoff(tmp_path, key)
    stranger.serve(parent=os.getppid())  # "torchrun" is some other process: our child is not its child
    try:
        asked = _ask_for_key(tmp_path)
        assert asked.stdout.split() == ["refused", "no_key"], asked.stderr
        assert not stranger.handed.is_set()
    finally:
        stranger.close()
    (tmp_path / "key.sock").unlink()
    handoff = KeyHandoff(tmp_path, key)
    handoff.serve(parent=os.getpid())  # this process plays torchrun: its child gets the key, once
    try:
        asked = _ask_for_key(tmp_path)
        assert asked.stdout.strip() == str(key.address), asked.stderr
        assert handoff.handed.wait(5)
        again = _ask_for_key(tmp_path)
        assert again.stdout.split() == ["refused", "no_key"], again.stderr
    finally:
        handoff.close()
