"""The whole RL loop across NAT, in network namespaces (prime_node/testing/netns_nat.py).

The trainer and a validator run on the public peer; one inferer runs in each home, behind its own NAT
router. They are the demo's processes (prime_node/demo/setup.py: same run config, model and command
lines), started inside the namespaces with their listen addresses there. Each home must learn it is
private, reserve a relay slot on the trainer, meet the other home through it, hole-punch to a direct
connection (their data planes then link over it: a home's data-plane port cannot be dialled), fetch the
trainer's checkpoints, and publish rollouts the validator accepts and the trainer trains on. (The demo's
checkpoints are too small for the homes to need each other's pieces; tests/p2p/test_nat_netns.py has the
piece trade between homes, with a larger checkpoint and a capped trainer uplink.)

``NatSwarm.run`` returns one flat dict of what happened (the NAT test asserts on it and
benchmarks/nat_swarm.py prints it): time to a relay slot and to a direct connection, accepted batches per
home, and the data-plane bytes per route, from the nodes' own status pages (polled inside each namespace:
a status API listens on its namespace's 127.0.0.1).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from prime_node.assets import copy_demo_model
from prime_node.demo.orchestrator import read_node_file
from prime_node.demo.setup import (
    DemoPlan,
    NodeSpec,
    create_wallets,
    joiner_command,
    trainer_command,
    write_run_config,
)
from prime_node.demo.summary import finished
from prime_node.testing.netns_nat import HOME_IP, PUBLIC_IP, NatLab

NAMESPACE = {"trainer": "pub", "validator-1": "pub", "inferer-1": "ha", "inferer-2": "hb"}
LISTEN = {
    "trainer": f"/ip4/{PUBLIC_IP}/tcp/4001",
    "validator-1": f"/ip4/{PUBLIC_IP}/tcp/4002",
    "inferer-1": f"/ip4/{HOME_IP['a']}/tcp/4001",
    "inferer-2": f"/ip4/{HOME_IP['b']}/tcp/4001",
}
HOMES = ("inferer-1", "inferer-2")
POLL_S = 2.0
_STATUS_SCRIPT = (
    "import sys, urllib.request\n"
    "with urllib.request.urlopen(sys.argv[1] + '/status', timeout=5) as answer:\n"
    "    sys.stdout.write(answer.read().decode())"
)


class NatSwarmError(RuntimeError):
    """A process of the NAT swarm exited, or the swarm did not get where it should in time."""


@dataclass
class _Process:
    node: NodeSpec
    process: subprocess.Popen[bytes]
    log: TextIO


@dataclass
class NatSwarm:
    """Start with ``run`` inside a ``NatLab`` (use ``NatLab.available()`` first)."""

    lab: NatLab
    workdir: Path
    steps: int = 6
    env: dict[str, str] = field(default_factory=dict)
    say: Callable[[str], None] = print
    _processes: list[_Process] = field(default_factory=list)
    snapshots: dict[str, dict[str, Any]] = field(default_factory=dict)

    def run(self, deadline_s: float) -> dict[str, Any]:
        """Run until the trainer finished ``steps`` steps, the homes' data planes linked and both homes
        know whether they are reachable; the result."""
        started = time.monotonic()
        try:
            plan = self._plan()
            self._start(plan.trainer, trainer_command(plan))
            bootstrap = self._wait_for_trainer(plan.trainer, started + 120)
            for node in plan.nodes[1:]:
                self._start(node, joiner_command(plan, node, bootstrap))
            self._watch(plan, started + deadline_s)
            return self._result(plan, time.monotonic() - started)
        finally:
            self.stop()

    def _plan(self) -> DemoPlan:
        model_dir = self.workdir / "model"
        copy_demo_model(model_dir)
        nodes = create_wallets(self.workdir, inferers=2, validators=1, adversary=None)
        plan = DemoPlan(self.workdir, tuple(nodes), self.steps, model_dir, {"seed": 0})
        write_run_config(plan)
        return plan

    def _start(self, node: NodeSpec, argv: list[str]) -> None:
        listen = argv.index("--listen")
        argv[listen + 1] = LISTEN[node.name]
        node.data_dir.mkdir(parents=True, exist_ok=True)
        log = node.log_path.open("w")
        process = subprocess.Popen(
            [*self.lab.exec_prefix(NAMESPACE[node.name]), *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env or None,
        )
        self._processes.append(_Process(node, process, log))

    def _wait_for_trainer(self, trainer: NodeSpec, deadline: float) -> str:
        while time.monotonic() < deadline:
            self._check_alive()
            document = _node_file(trainer)
            for address in document.get("multiaddrs") or []:
                if isinstance(address, str) and PUBLIC_IP in address and "/p2p/" in address:
                    return address
            time.sleep(0.25)
        raise NatSwarmError(f"the trainer did not come up in time\n{self._tails()}")

    def _watch(self, plan: DemoPlan, deadline: float) -> None:
        while True:
            for node in plan.nodes:
                snapshot = self._poll(node)
                if snapshot is not None:
                    self.snapshots[node.name] = snapshot
            trainer = self.snapshots.get("trainer")
            if finished(trainer, plan.steps) and self._homes_linked(plan) and self._homes_probed():
                return
            self._check_alive()
            if time.monotonic() > deadline:
                raise NatSwarmError(f"not done in time: {self._brief(plan)}\n{self._tails()}")
            time.sleep(POLL_S)

    def _poll(self, node: NodeSpec) -> dict[str, Any] | None:
        api = _node_file(node).get("api")
        if not isinstance(api, str):
            return None
        argv = [*self.lab.exec_prefix(NAMESPACE[node.name]), sys.executable, "-c", _STATUS_SCRIPT, api]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=15, check=False)
            value = json.loads(done.stdout) if done.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def _homes_linked(self, plan: DemoPlan) -> bool:
        """Each home's data plane received frames from the other's."""
        a, b = (self._by_peer(name) for name in HOMES)
        address = {node.name: node.address.lower() for node in plan.nodes}
        return (
            int(a.get(address[HOMES[1]], {}).get("in", 0)) > 0
            and int(b.get(address[HOMES[0]], {}).get("in", 0)) > 0
        )

    def _homes_probed(self) -> bool:
        """Each home has a reachability verdict. A probe the public peer answers late (a loaded machine:
        its dial-back waits on a busy trainer) leaves a home "unknown" for another round (5 s after it,
        reachability_service.py); the swarm can finish its steps before that, as it did once in CI."""
        statuses = [self._section(name, "reachability").get("status") for name in HOMES]
        return all(status not in (None, "unknown") for status in statuses)

    def _section(self, name: str, section: str) -> dict[str, Any]:
        sections = (self.snapshots.get(name) or {}).get("sections") or {}
        value = sections.get(section)
        return value if isinstance(value, dict) else {}

    def _by_peer(self, name: str) -> dict[str, dict[str, Any]]:
        table = self._section(name, "checkpoints").get("by_peer") or {}
        return {str(peer).lower(): entry for peer, entry in table.items() if isinstance(entry, dict)}

    def _brief(self, plan: DemoPlan) -> dict[str, Any]:
        training = self._section("trainer", "training")
        return {
            "step": training.get("step"),
            "accepted_by_worker": training.get("accepted_by_worker"),
            "reach": {name: self._section(name, "reachability") for name in HOMES},
            "by_peer": {name: self._by_peer(name) for name in HOMES},
        }

    def _result(self, plan: DemoPlan, wall_s: float) -> dict[str, Any]:
        address = {node.name: node.address.lower() for node in plan.nodes}
        name_of = {value: key for key, value in address.items()}
        training = self._section("trainer", "training")
        accepted = {str(k).lower(): v for k, v in (training.get("accepted_by_worker") or {}).items()}
        routes: dict[str, int] = {}
        home_to_home: dict[str, dict[str, Any]] = {}
        for node in plan.nodes:
            for peer, entry in self._by_peer(node.name).items():
                size, route = int(entry.get("in", 0)), str(entry.get("route"))
                routes[route] = routes.get(route, 0) + size
                if node.name in HOMES and name_of.get(peer) in HOMES:
                    home_to_home[f"{name_of[peer]}->{node.name}"] = {"bytes": size, "route": route}
        total_in = sum(routes.values())
        reach = {name: self._section(name, "reachability") for name in HOMES}
        return {
            "wall_s": round(wall_s, 1),
            "steps": training.get("step"),
            "accepted_batches": {name: accepted.get(address[name], 0) for name in HOMES},
            "checkpoint_bytes_in": {
                name: self._section(name, "checkpoints").get("bytes_in", 0) for name in HOMES
            },
            "time_to_direct_s": {name: reach[name].get("time_to_direct_s") for name in HOMES},
            "hole_punches_ok": {name: reach[name].get("hole_punches_ok") for name in HOMES},
            "reachability": {name: reach[name].get("status") for name in HOMES},
            "dataplane_bytes_in_by_route": routes,
            "relayed_share": round(routes.get("relayed", 0) / total_in, 4) if total_in else None,
            "home_to_home": home_to_home,
            "relayed_refused": {
                name: self._section(name, "checkpoints").get("dataplane_relayed_refused") for name in HOMES
            },
        }

    def _check_alive(self) -> None:
        for child in self._processes:
            if child.process.poll() is not None:
                raise NatSwarmError(
                    f"{child.node.name} exited with {child.process.returncode}\n{self._tails()}"
                )

    def _tails(self) -> str:
        parts = []
        for child in self._processes:
            child.log.flush()
            try:
                text = child.node.log_path.read_text(errors="replace")
            except OSError:
                text = ""
            parts.append(f"--- {child.node.name} ---\n{text[-2500:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        for child in self._processes:
            if child.process.poll() is None:
                child.process.terminate()
        for child in self._processes:
            try:
                child.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait(timeout=5)
            child.log.close()
        self._processes.clear()


def _node_file(node: NodeSpec) -> dict[str, Any]:
    return read_node_file(node) or {}
