"""Run the demo: make the model, wallets and run config, start the swarm, watch it, stop it, summarize.

Everything the demo starts is a child of one ``Supervisor``; it is stopped on success, on any error, on
Ctrl-C and on SIGTERM (which is turned into the same exception as Ctrl-C), so nothing is left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from prime_node.assets import copy_demo_model
from prime_node.atomic_files import write_atomically
from prime_node.demo.setup import (
    DemoPlan,
    NodeSpec,
    create_wallets,
    joiner_command,
    trainer_command,
    write_run_config,
)
from prime_node.demo.summary import finished, summarize, training_progress
from prime_node.demo.supervisor import Child, Supervisor
from prime_node.errors import NodeError

START_TIMEOUT_S = 180.0
POLL_INTERVAL_S = 1.0
FETCH_TIMEOUT_S = 3.0
PROGRESS_EVERY_S = 15.0
LOG_TAIL_LINES = 25


class DemoStopped(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) reached the demo: handled exactly like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass(frozen=True)
class DemoOptions:
    inferers: int = 2
    validators: int = 1
    adversary: str | None = None
    steps: int = 300
    tui: bool = True
    workdir: Path | None = None
    keep: bool = False
    model_dir: Path | None = None
    timeout_s: float = 1200.0
    seed: int = 0
    extra_config: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class DemoResult:
    summary: dict[str, Any]
    workdir: Path
    kept: bool


def child_env() -> dict[str, str]:
    """Every process shares the machine's cores: one torch/BLAS thread each, unbuffered logs."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        PRIME_NODE_LOG_LEVEL=os.environ.get("PRIME_NODE_DEMO_LOG_LEVEL", "info"),
    )
    env.pop("PRIME_NODE_KEYSTORE", None)
    env.pop("PRIME_NODE_PASSWORD_FILE", None)
    return env


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into ``DemoStopped`` and SIGINT into ``KeyboardInterrupt`` for the duration.

    SIGINT is set explicitly: a shell without job control starts background commands (``demo &`` in a
    script, a CI step) with SIGINT ignored, and Python then keeps it ignored, so ``kill -INT`` would
    leave the whole swarm running."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise DemoStopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def prepare_workdir(options: DemoOptions) -> Path:
    if options.workdir is None:
        return Path(tempfile.mkdtemp(prefix="prime-node-demo-"))
    workdir = options.workdir.expanduser().resolve()
    if workdir.exists() and any(workdir.iterdir()):
        raise NodeError(f"--workdir {workdir} is not empty", reason="exists")
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


def make_model(model_dir: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Copy the packaged tiny arithmetic model, warmed up once by ``scripts/make_demo_model.py``.

    Not warmed up here: the same seeded warm-up trains a different model on another CPU (DESIGN §11), so
    every machine starts the demo from these same weights."""
    started = time.monotonic()
    info = copy_demo_model(model_dir)
    info["seconds"] = round(time.monotonic() - started, 1)
    say(
        f"model: {info['parameters']} parameters, from the package (warm-up {info['warmup_steps']} steps,"
        f" seed {info['seed']}, held-out {info['heldout_accuracy']} when made)"
    )
    return info


def read_node_file(node: NodeSpec) -> dict[str, Any] | None:
    """The node's node.json if it says the node is running (None while it starts)."""
    try:
        document = json.loads((node.data_dir / "node.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("state") != "running":
        return None
    return document


def fetch(node: NodeSpec) -> dict[str, Any] | None:
    from prime_node.status.client import fetch_snapshot

    document = read_node_file(node)
    if document is None or not isinstance(document.get("api"), str):
        return None
    try:
        return fetch_snapshot(str(document["api"]).rstrip("/"), timeout=FETCH_TIMEOUT_S)
    except NodeError:
        return None


@dataclass(frozen=True)
class NodeCommands:
    """How each node is started (the real CLI by default; tests may start stand-ins)."""

    trainer: Callable[[DemoPlan], list[str]] = trainer_command
    joiner: Callable[[DemoPlan, NodeSpec, str], list[str]] = joiner_command


class Demo:
    """One demo run. ``run()`` returns the summary; the supervisor is always stopped on the way out."""

    def __init__(
        self,
        options: DemoOptions,
        *,
        say: Callable[[str], None],
        console: Any = None,
        commands: NodeCommands | None = None,
    ) -> None:
        self.options = options
        self.commands = commands or NodeCommands()
        self.say = say
        self.console = console
        self.supervisor = Supervisor(child_env(), warm_start=True)
        self.snapshots: dict[str, dict[str, Any] | None] = {}
        self.plan: DemoPlan | None = None
        self.started = time.monotonic()
        self.adversary_kind: str | None = None

    # -- setup --------------------------------------------------------------------------------------------

    def _plan(self, workdir: Path) -> DemoPlan:
        options = self.options
        kind = options.adversary
        if kind == "random":
            from prime_node.verification.cheating import ATTACKS

            kind = random.Random(options.seed).choice(ATTACKS)
        self.adversary_kind = kind
        model_dir = options.model_dir.resolve() if options.model_dir is not None else workdir / "model"
        if options.model_dir is None:
            make_model(model_dir, self.say)
        nodes = create_wallets(workdir, options.inferers, options.validators, kind)
        extra = {"seed": options.seed, **options.extra_config}
        plan = DemoPlan(workdir, tuple(nodes), options.steps, model_dir, extra)
        write_run_config(plan)
        return plan

    def _record(self) -> None:
        plan = self.plan
        if plan is None:
            return
        document = {
            "pid": os.getpid(),
            "workdir": str(plan.workdir),
            "run_config": str(plan.run_config_path),
            "children": [
                {"name": c.name, "pid": c.pid, "log": str(c.log_path), "argv": list(c.argv)}
                for c in self.supervisor.children
            ],
        }
        write_atomically(plan.workdir / "demo.json", json.dumps(document, indent=2) + "\n")

    def _start(self, node: NodeSpec, argv: list[str]) -> Child:
        child = self.supervisor.start(node.name, argv, node.log_path)
        self._record()
        return child

    def _check_children(self, *, allow_trainer_exit: bool = False) -> None:
        for child in self.supervisor.exited():
            code = child.process.returncode
            if allow_trainer_exit and child.name == "trainer" and code == 0:
                continue
            raise self._child_failed(child, f"{child.name} exited with status {code}")

    def _child_failed(self, child: Child, what: str) -> NodeError:
        self.say(f"--- last lines of {child.log_path} ---\n{child.log_tail(LOG_TAIL_LINES)}\n---")
        for other in self.supervisor.children:
            self.say(f"log of {other.name}: {other.log_path}")
        return NodeError(f"{what} (log: {child.log_path})", reason="demo_failed")

    def _wait_for_bootstrap(self, trainer: Child) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.plan is not None
        while time.monotonic() < deadline:
            self._check_children()
            document = read_node_file(self.plan.trainer)
            if document is not None:
                for address in document.get("multiaddrs") or []:
                    if isinstance(address, str) and "/p2p/" in address:
                        return address
            time.sleep(0.25)
        raise self._child_failed(trainer, f"the trainer did not come up within {START_TIMEOUT_S:.0f} s")

    # -- the run ------------------------------------------------------------------------------------------

    def run(self, workdir: Path) -> dict[str, Any]:
        with self.supervisor:
            self.plan = plan = self._plan(workdir)
            self.snapshots = {node.name: None for node in plan.nodes}
            trainer = self._start(plan.trainer, self.commands.trainer(plan))
            self.say(f"trainer {plan.trainer.address} starting (log {plan.trainer.log_path})")
            bootstrap = self._wait_for_bootstrap(trainer)
            self.say(f"trainer listening at {bootstrap}")
            for node in plan.nodes[1:]:
                self._start(node, self.commands.joiner(plan, node, bootstrap))
            self.say(
                f"started {len(plan.nodes) - 1} nodes: "
                + ", ".join(f"{n.name} {n.address}" for n in plan.nodes[1:])
            )
            self._watch()
            wall_s = time.monotonic() - self.started
        return self._summary(wall_s)

    def _watch(self) -> None:
        assert self.plan is not None
        plan, options = self.plan, self.options
        deadline = self.started + options.timeout_s
        live = None
        if options.tui and self.console is not None:
            from rich.live import Live

            live = Live(console=self.console, auto_refresh=False, transient=False)
            live.start()
        last_progress = 0.0
        try:
            while True:
                for node in plan.nodes:
                    if node.name == "trainer" or self.supervisor_child(node.name).running():
                        snapshot = fetch(node)
                        if snapshot is not None:
                            self.snapshots[node.name] = snapshot
                trainer_snapshot = self.snapshots.get("trainer")
                if live is not None:
                    live.update(self._render(), refresh=True)
                elif time.monotonic() - last_progress >= PROGRESS_EVERY_S:
                    last_progress = time.monotonic()
                    self.say(self._progress_line())
                if finished(trainer_snapshot, plan.steps):
                    return
                trainer_child = self.supervisor_child("trainer")
                if not trainer_child.running() and trainer_child.process.returncode == 0:
                    return  # the trainer finished its steps and exited on its own
                self._check_children()
                if time.monotonic() > deadline:
                    raise self._child_failed(
                        trainer_child, f"the demo did not finish within {options.timeout_s:.0f} s"
                    )
                time.sleep(POLL_INTERVAL_S)
        finally:
            if live is not None:
                live.stop()

    def supervisor_child(self, name: str) -> Child:
        return next(child for child in self.supervisor.children if child.name == name)

    def _render(self) -> Any:
        from prime_node.demo.view import render

        assert self.plan is not None
        return render(
            self.snapshots,
            {node.name: node.role for node in self.plan.nodes},
            steps=self.plan.steps,
            elapsed_s=time.monotonic() - self.started,
            adversary=self.adversary_kind,
        )

    def _progress_line(self) -> str:
        assert self.plan is not None
        step, held_out = training_progress(self.snapshots.get("trainer"))
        answered = sum(1 for s in self.snapshots.values() if s is not None)
        accuracy = f", held-out {held_out[0][1]:.2f} -> {held_out[-1][1]:.2f}" if held_out else ""
        return (
            f"{time.monotonic() - self.started:5.0f} s: step {step}/{self.plan.steps}{accuracy}, "
            f"{answered}/{len(self.plan.nodes)} nodes answering"
        )

    def _summary(self, wall_s: float) -> dict[str, Any]:
        assert self.plan is not None
        plan = self.plan
        adversary = plan.adversary
        processes = [
            {
                "name": child.name,
                "pid": child.pid,
                "exit": child.process.returncode,
                "log": str(child.log_path),
            }
            for child in self.supervisor.children
        ]
        summary = summarize(
            self.snapshots,
            {node.name: node.role for node in plan.nodes},
            addresses={node.name: node.address for node in plan.nodes},
            adversary_address=adversary.address if adversary else None,
            adversary_kind=self.adversary_kind,
            wall_s=wall_s,
            processes=processes,
        )
        with contextlib.suppress(OSError):  # the raw documents, for a look afterwards (--keep)
            (plan.workdir / "status.json").write_text(json.dumps(self.snapshots, indent=1) + "\n")
        summary["workdir"] = str(plan.workdir)
        summary["config"] = {
            "inferers": self.options.inferers,
            "validators": self.options.validators,
            "adversary": self.adversary_kind,
            "steps": plan.steps,
        }
        return summary


def run_demo(
    options: DemoOptions,
    *,
    say: Callable[[str], None],
    console: Any = None,
    commands: NodeCommands | None = None,
) -> DemoResult:
    """Run the demo to its end; on success the temporary workdir is removed unless ``keep``."""
    workdir = prepare_workdir(options)
    keep = options.keep or options.workdir is not None
    say(f"workdir {workdir}")
    demo = Demo(options, say=say, console=console, commands=commands)
    with stop_signals_raise():
        try:
            summary = demo.run(workdir)
        except BaseException:
            say(f"demo stopped; its files stay in {workdir}")
            raise
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return DemoResult(summary, workdir, keep)
