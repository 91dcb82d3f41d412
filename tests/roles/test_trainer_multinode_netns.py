"""``prime-node run-trainer`` across two machines: two network namespaces joined by a veth pair act as
two nodes (one rank each, gloo over the veth, the static rendezvous at node 0's address).

Node 0 (namespace ``a``, 10.77.0.1) is the networked trainer with the key, and its inferer and validator
run beside it; node 1 (namespace ``b``, 10.77.0.2) has no keystore and only trains. Both see this
machine's file system, the shared storage a multi-node run needs. The run trains, checkpoints (both
ranks' DCP shards) and publishes; killing node 1 ends the run on node 0 too (no elastic restarts);
started again, both resume from the newest checkpoint and continue with the next step.

Slow and root-only; skipped where network namespaces are not available.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from prime_node.demo.orchestrator import child_env, read_node_file
from prime_node.demo.setup import (
    DemoPlan,
    cli,
    create_wallets,
    demo_run_config,
    joiner_command,
    toml_text,
    trainer_command,
)
from prime_node.demo.supervisor import Child, Supervisor

NODE_IP = {"a": "10.77.0.1", "b": "10.77.0.2"}
SMALL_RUN = {"group_size": 4, "prompts_per_step": 4, "async_level": 2, "eval_tasks": 16, "eval_every": 0}
PORT = 29455


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=20, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {done.stderr.strip()}")
    return done


def _why_no_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "ip is not installed"
    if _ip("netns", "list", check=False).returncode != 0:
        return "ip netns is not usable"
    return None


@pytest.fixture
def two_hosts() -> Iterator[dict[str, list[str]]]:
    """Namespaces a and b joined by a veth pair; yields each one's ``ip netns exec`` prefix. Removed
    afterwards, whatever happened (deleting a namespace deletes its end of the pair, hence both)."""
    why = _why_no_namespaces()
    if why is not None:
        pytest.skip(f"network namespaces: {why}")
    prefix = f"pn-mn-{os.getpid()}"
    names = {side: f"{prefix}-{side}" for side in NODE_IP}
    made: list[str] = []
    try:
        for name in names.values():
            _ip("netns", "add", name)
            made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip(
            "link",
            "add",
            "mn0",
            "netns",
            names["a"],
            "type",
            "veth",
            "peer",
            "name",
            "mn1",
            "netns",
            names["b"],
        )
        for side, device in (("a", "mn0"), ("b", "mn1")):
            _ip("-n", names[side], "addr", "add", f"{NODE_IP[side]}/24", "dev", device)
            _ip("-n", names[side], "link", "set", device, "up")
        yield {side: ["ip", "netns", "exec", name] for side, name in names.items()}
    finally:
        for name in made:
            _ip("netns", "del", name, check=False)


@pytest.fixture(scope="module")
def warm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's warmed-up tiny model: sampled rewards differ within a group, so steps train."""
    from prime_node.assets import copy_demo_model

    out = tmp_path_factory.mktemp("warm") / "model"
    copy_demo_model(out)
    return out


def _plan(tmp_path: Path, model_dir: Path, *, steps: int) -> DemoPlan:
    nodes = create_wallets(tmp_path, inferers=1, validators=1, adversary=None)
    plan = DemoPlan(tmp_path, tuple(nodes), steps, model_dir)
    config = demo_run_config(
        model_dir=model_dir,
        output_dir=tmp_path / "shared" / "output",  # both "machines" see it: the shared storage
        trainer_address=plan.trainer.address,
        validator_addresses=[node.address for node in plan.of_role("validator")],
        steps=steps,
    )
    plan.run_config_path.write_text(toml_text({**config, **SMALL_RUN}), encoding="utf-8")
    return plan


def _lines(child: Child) -> list[dict[str, Any]]:
    found = []
    for line in child.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
    return found


def _wait(what: str, condition: Callable[[], bool], children: list[Child], timeout: float) -> None:
    """Until ``condition``; a guard against a hang, failing early if one of ``children`` exits."""
    deadline = time.monotonic() + timeout
    while not condition():
        for child in children:
            assert child.running(), f"{child.name} exited while waiting for {what}:\n{child.log_tail(40)}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s:\n" + "\n".join(
            child.log_tail(20) for child in children
        )
        time.sleep(0.5)


class _Cluster:
    """The two trainer nodes and node 0's two workers, (re)started with fresh logs per round."""

    def __init__(
        self, supervisor: Supervisor, plan: DemoPlan, hosts: dict[str, list[str]], steps: int
    ) -> None:
        self.supervisor, self.plan, self.hosts, self.steps = supervisor, plan, hosts, steps

    def start(self, round_: int) -> tuple[Child, Child, list[Child]]:
        flags = ["--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", f"{NODE_IP['a']}:{PORT}"]
        logs = self.plan.workdir / f"round{round_}"
        logs.mkdir()
        node0 = self.supervisor.start(
            f"node0-{round_}",
            [*self.hosts["a"], *trainer_command(self.plan), *flags, "--node-rank", "0"],
            logs / "node0.log",
        )
        node1_dir = self.plan.workdir / "node1"  # no keystore: node 1 holds no rank 0, so it never signs
        node1 = self.supervisor.start(
            f"node1-{round_}",
            [
                *self.hosts["b"],
                *cli(),
                "run-trainer",
                "--config",
                str(self.plan.run_config_path),
                "--data-dir",
                str(node1_dir),
                *flags,
                "--node-rank",
                "1",
            ],
            logs / "node1.log",
        )
        _wait("node 0's node.json", lambda: _fresh_node_file(self.plan, node0), [node0, node1], 300)
        node = read_node_file(self.plan.trainer)
        assert node is not None
        bootstrap = next(a for a in node["multiaddrs"] if "/p2p/" in a)
        workers = [
            self.supervisor.start(
                f"{joiner.name}-{round_}",
                [*self.hosts["a"], *joiner_command(self.plan, joiner, bootstrap)],
                logs / f"{joiner.name}.log",
            )
            for joiner in self.plan.nodes[1:]
        ]
        return node0, node1, workers


def _fresh_node_file(plan: DemoPlan, node0: Child) -> bool:
    node = read_node_file(plan.trainer)
    return (
        node is not None and _alive(int(node["pid"])) and _descends_from(int(node["pid"]), node0.process.pid)
    )


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            return False
    return False


def _rank0_steps(node0: Child) -> list[int]:
    return [line["step"] for line in _lines(node0) if "policy_step" in line and "rank" not in line]


def _rank1(node1: Child) -> list[dict[str, Any]]:
    return [line for line in _lines(node1) if line.get("rank") == 1]


def _complete_shards(output: Path) -> dict[int, set[str]]:
    """Step -> the DCP shard files of each complete sharded checkpoint."""
    root = output / "train_state"
    return {
        step: {p.name for p in (root / f"sharded_{step:08d}").glob("*.distcp")}
        for step in _steps(root, "sharded_")
        if (root / f"sharded_{step:08d}" / "complete.json").is_file()
    }


def _steps(root: Path, prefix: str) -> list[int]:
    """The steps of ``root``'s ``PREFIX00000012`` directories (not the temporary ones being written)."""
    pattern = re.compile(re.escape(prefix) + r"(\d{8})")
    return sorted(int(m.group(1)) for p in root.glob(f"{prefix}*") if (m := pattern.fullmatch(p.name)))


def _stop(child: Child) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    try:
        child.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.process.wait()


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_two_nodes_train_checkpoint_publish_and_resume_after_one_is_killed(
    tmp_path: Path, warm_model_dir: Path, two_hosts: dict[str, list[str]]
) -> None:
    plan = _plan(tmp_path, warm_model_dir, steps=50)
    output = tmp_path / "shared" / "output"
    with Supervisor(child_env()) as supervisor:
        cluster = _Cluster(supervisor, plan, two_hosts, steps=50)
        node0, node1, workers = cluster.start(1)
        both = [node0, node1]

        def trained(count: int) -> bool:
            done = _rank0_steps(node0)
            taken = {line["step"] for line in _rank1(node1) if "step" in line}
            return len(done) >= count and taken >= set(done)

        _wait("2 steps on both nodes", lambda: trained(2), both, 600)
        first = _rank0_steps(node0)
        assert first == list(range(1, len(first) + 1))
        follower = _rank1(node1)
        assert follower[0]["following_from_step"] == 0
        # Checkpointed: both ranks' shards in one complete sharded checkpoint, beside the published policy.
        _wait(
            "a sharded checkpoint of a trained step",
            lambda: any(s >= 1 for s in _complete_shards(output)),
            both,
            120,
        )
        shards = _complete_shards(output)
        assert all(files == {"__0_0.distcp", "__1_0.distcp"} for files in shards.values()), shards
        published = _steps(output / "checkpoints", "step_")
        assert published and published[-1] >= 1
        assert (output / "checkpoints" / f"step_{published[-1]:08d}" / "model.safetensors").is_file()
        # Gloo ran over the veth: node 1's rank reached node 0 at 10.77.0.1, not over a loopback.
        assert "gloo on mn1" in node1.log_tail(400) and "gloo on mn0" in node0.log_tail(400)

        # Kill node 1 (its torchrun and its rank, as a machine dies): node 0's rank loses its peer in
        # the next collective, and without elastic restarts node 0's torchrun ends the run.
        torchrun1 = _children(node1.process.pid)
        ranks1 = [pid for parent in torchrun1 for pid in _children(parent)]
        assert torchrun1 and ranks1
        for pid in [*torchrun1, *ranks1]:
            os.kill(pid, signal.SIGKILL)
        node0.process.wait(timeout=300)  # hang guards: the exit statuses say what happened
        node1.process.wait(timeout=60)
        assert node0.process.returncode == 1, node0.log_tail(40)
        tail = node0.log_tail(40)
        assert "a trainer rank failed" in tail
        # Rank 0 says in one line that its peer is gone, at node 1's veth address: gloo ran over the link.
        assert "error: trainer rank 0: a collective failed" in tail and "10.77.0.2" in tail, tail
        assert "torchrun was killed (signal 9)" in node1.log_tail(40)
        assert node1.process.returncode == 1, node1.log_tail(40)
        for worker in workers:
            _stop(worker)
        killed_at = max(_rank0_steps(node0))
        before = {line["step"]: line for line in _rank1(node1) if "step" in line}
        resume_from = max(step for step, files in _complete_shards(output).items() if len(files) == 2)
        assert 1 <= resume_from <= killed_at

        # Both started again: they load the newest complete checkpoint, replay the logged steps after it
        # (the batches trained before the kill, from the rollout log) and train on from the next one.
        node0, node1, workers = cluster.start(2)
        both = [node0, node1]
        _wait("a new step on both nodes", lambda: trained(1), both, 600)
        again = _rank0_steps(node0)
        follower = _rank1(node1)
        assert follower[0]["following_from_step"] == resume_from
        taken = [line["step"] for line in follower[1:]]
        assert taken == list(range(resume_from + 1, resume_from + 1 + len(taken)))
        assert again == list(range(again[0], again[0] + len(again)))
        assert killed_at <= again[0] - 1 <= killed_at + 1  # the kill may fall between logging and printing
        # What was replayed is what was trained: the same batches through the same gradients.
        for line in follower[1:]:
            if line["step"] < again[0] and line["step"] in before:
                old = before[line["step"]]
                assert (line["policy_step"], line["groups_kept"]) == (old["policy_step"], old["groups_kept"])
                assert line["grad_norm"] == pytest.approx(old["grad_norm"], rel=1e-4)
