"""The demo's orchestrator with plain ``prime-node join`` nodes standing in for the trainer and roles.

Run as ``python -m tests.demo.standin WORKDIR MODEL_DIR``: it starts the real Demo (wallets, run config,
supervisor, status polling) but every node is an ordinary joiner, so supervision and stopping can be
tested without training. It runs until signalled (or its timeout).
"""

from __future__ import annotations

import sys
from pathlib import Path

from prime_node.demo.orchestrator import DemoOptions, NodeCommands, run_demo
from prime_node.demo.setup import RUN_ID, DemoPlan, NodeSpec, cli


def _common(node: NodeSpec) -> list[str]:
    return [
        *cli(),
        "join",
        "--data-dir",
        str(node.data_dir),
        "--keystore",
        str(node.keystore),
        "--no-password",
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--run",
        RUN_ID,
        "--heartbeat-interval",
        "1",
    ]


def trainer(plan: DemoPlan) -> list[str]:
    return _common(plan.trainer)


def joiner(plan: DemoPlan, node: NodeSpec, bootstrap: str) -> list[str]:
    role = "validator" if node.role == "validator" else "inferer"
    return [*_common(node), "--bootstrap", bootstrap, "--role", role]


def main() -> None:
    workdir, model = Path(sys.argv[1]), Path(sys.argv[2])
    options = DemoOptions(
        inferers=2, validators=1, adversary="forged_proof", steps=5, tui=False,
        workdir=workdir, model_dir=model, timeout_s=float(sys.argv[3]) if len(sys.argv) > 3 else 120.0,
    )  # fmt: skip
    run_demo(options, say=lambda line: print(line, flush=True), commands=NodeCommands(trainer, joiner))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as stopped:
        print(f"stopped: {type(stopped).__name__}", flush=True)
        sys.exit(130 if type(stopped) is KeyboardInterrupt else 143)
