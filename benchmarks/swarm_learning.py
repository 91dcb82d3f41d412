"""Swarm vs local learning: does the networked loop keep the trainer as busy, and learn as much per step?

For each seed, on this machine, one after the other (never at once, so neither steals the other's cores):
1. the local trainer (`run-trainer --local`: inference in a child process, no network) runs the demo's
   recipe (the run config `prime-node demo` writes: same model, group size, prompts per step, learning
   rate, objective, async level, seed) for S steps;
2. `prime-node demo --steps S --seed <seed>` runs the same recipe over the swarm: trainer, validator,
   inferers (and the demo's cheating inferer unless --adversary none) as separate processes on
   127.0.0.1, real libp2p, TOPLOC proofs, signed verdicts.
Both start from the same model (the one the demo ships) and evaluate the same held-out tasks.

Prints ONE JSON line:
- ``steps_per_s_local``, ``steps_per_s_swarm``: steady-state trainer steps per second (from the end of
  the first step to the last; start-up excluded), medians over seeds; ``steps_per_s_ratio`` = swarm /
  local (goal >= 0.5);
- ``gain_local_at_equal_steps``, ``gain_swarm``: held-out greedy accuracy after S steps minus before
  (means over seeds); ``parity`` = mean swarm gain / mean local gain (goal >= 0.9), and per seed;
- ``round_trip_s``: where one batch's round trip goes, seconds per batch, from the stage timers every
  node reports in its status (inferer: generate, prove, sign, publish; validator: gossip delivery,
  queue, policy wait, validate, verdict publish; trainer: rollout/verdict delivery, waiting for the
  verdict, admission, queue, train), means over seeds;
- ``busy_share``: the trainer's time in ``train`` / its wall time from the start of the first step to the
  last (the trainer's own ``busy_share``; issue 38's goal >= 0.8 in the confined run), median over seeds;
- ``stale_share``: batches refused as ``stale`` or ``stale_in_queue`` / rollout batches produced by every
  inferer (the adversary included), over all seeds (goal <= 0.05);
- ``verdict_round_trip_s``: a batch's way from its inferer to the trainer's verdict in hand, seconds per
  batch: the validator's stages (delivery, queue, policy wait, validate, verdict publish) plus the
  trainer's verdict delivery, means over seeds (what the trainer would wait per batch without overlap);
- ``swarm_wall_s``: the demo's whole wall time (start-up included);
- ``stale_kinds_by_seed``: where the stale share comes from: ``stale`` (refused on arrival at the
  trainer), ``stale_in_queue`` (accepted, then too old before a step took it) and the validator's
  ``below_floor`` (dropped on arrival there, not judged; not in ``stale_share``); ``ages_by_seed``: the
  trainer's batches by age in steps (trainer step - policy step) on arrival, when trained, and on arrival
  for those later dropped ``stale_in_queue``; ``demand_by_seed``: the trainer's last demand and its depth;
- ``train_slowdown``: the swarm trainer's seconds in ``train`` per step / the local run's seconds per
  step, median over seeds, and ``trainer_time_s_by_seed`` (train, waiting, write, share, eval): with
  ``busy_share`` they decompose the ratio (ratio = busy_share / train_slowdown, start-up aside): time the
  trainer waits for batches, and a training step slowed by the processes it shares the cores with.

``--confined`` pins the swarm's processes to two cores: the trainer to the last one, every other demo
process (validator, inferers, the adversary, and this script, which polls their status) to the first
(``taskset``), so the ratio says what the protocol costs rather than what five processes sharing two cores
cost. The local run is not pinned (it runs one trainer and one inference process, one thread each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STAGES = {
    "inferer": ("rollouts", ("generate", "prove", "sign", "publish")),
    "validator": ("validation", ("delivery", "queue", "policy_wait", "validate", "publish_verdict")),
    "trainer": (
        "training",
        ("rollout_delivery", "await_verdict", "verdict_delivery", "admit", "queue", "train", "write_share"),
    ),
}


def local_run(model_dir: Path, work: Path, steps: int, seed: int) -> dict[str, Any]:
    from prime_node.config import RunConfig
    from prime_node.demo.setup import demo_run_config
    from prime_node.ml.local_run import run_local

    data = demo_run_config(
        model_dir=model_dir,
        output_dir=work / f"local-{seed}",
        trainer_address="0x" + "00" * 20,
        validator_addresses=["0x" + "11" * 20],
        steps=steps,
        seed=seed,
    )
    config = RunConfig.model_validate(data)
    began = time.perf_counter()
    result = run_local(config, model_dir=model_dir)
    evals = [(e.step, e.accuracy) for e in result.evals]
    return {
        "steps_per_s": round(result.steps_per_s, 3),
        "held_out": evals,
        "gain": round(evals[-1][1] - evals[0][1], 4),
        "wall_s": round(time.perf_counter() - began, 1),
    }


def confined_commands(trainer_cpu: int, others_cpu: int) -> Any:
    """The demo's node commands behind ``taskset -c``: the trainer on one core, every joiner on another."""
    from prime_node.demo.orchestrator import NodeCommands
    from prime_node.demo.setup import joiner_command, trainer_command

    def trainer(plan: Any) -> list[str]:
        return ["taskset", "-c", str(trainer_cpu), *trainer_command(plan)]

    def joiner(plan: Any, node: Any, bootstrap: str) -> list[str]:
        return ["taskset", "-c", str(others_cpu), *joiner_command(plan, node, bootstrap)]

    return NodeCommands(trainer=trainer, joiner=joiner)


def swarm_run(
    model_dir: Path, work: Path, steps: int, seed: int, adversary: str, *, confined: bool = False
) -> dict[str, Any]:
    """``prime-node demo --json --no-tui`` (run in this process, so ``--confined`` can pin its children)."""
    from prime_node.demo.orchestrator import DemoOptions, run_demo

    workdir = work / f"swarm-{seed}"
    commands = None
    if confined:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--confined needs two cores")
        commands = confined_commands(cpus[-1], cpus[0])
        os.sched_setaffinity(0, {cpus[0]})  # this process polls status: it shares the joiners' core
    options = DemoOptions(
        adversary=None if adversary == "none" else adversary,
        steps=steps,
        tui=False,
        workdir=workdir,
        model_dir=model_dir,
        timeout_s=1800.0,
        seed=seed,
    )
    began = time.perf_counter()
    try:
        summary = run_demo(options, say=lambda line: print(line, file=sys.stderr), commands=commands).summary
    finally:
        if confined:
            os.sched_setaffinity(0, set(cpus))
    snapshots = json.loads((workdir / "status.json").read_text())
    return swarm_result(summary, snapshots, wall_s=time.perf_counter() - began)


def swarm_result(summary: dict[str, Any], snapshots: dict[str, Any], *, wall_s: float) -> dict[str, Any]:
    """One swarm run's figures from the demo's summary and every node's last status."""
    trainer = snapshots["trainer"]["sections"]["training"]
    held = summary["held_out"]
    refused = summary["batches_rejected"]
    produced = sum(
        int(node.get("rollouts", {}).get("produced", 0))
        for node in summary["nodes"].values()
        if node.get("role") in ("inferer", "adversary")
    )
    trips = round_trip(snapshots)
    return {
        "steps_per_s": trainer["steps_per_s"],
        "held_out": held,
        "gain": round(held[-1][1] - held[0][1], 4),
        "wall_s": round(wall_s, 1),
        "stale": refused.get("stale", 0) + refused.get("stale_in_queue", 0),
        "stale_in_queue": refused.get("stale_in_queue", 0),
        "produced": produced,
        "busy_share": trainer.get("busy_share", busy_share(trainer)),
        "batches_trained": trainer.get("batches_trained"),
        "adversary_accepted": summary.get("adversary_accepted"),
        "round_trip_s": trips,
        "verdict_round_trip_s": round(sum(trips.get(stage, 0.0) for stage in VERDICT_TRIP), 4),
        "demand": trainer.get("demand"),
        "ages": trainer.get("ages"),
        "below_floor": sum(
            int(node.get("validation", {}).get("rejected", {}).get("below_floor", 0))
            for node in summary["nodes"].values()
        ),
        "train_s_per_step": (trainer.get("stages", {}).get("train") or {}).get("mean_s"),
        "time_s": trainer.get("time_s"),
    }


VERDICT_TRIP = (
    "validator.delivery",
    "validator.queue",
    "validator.policy_wait",
    "validator.validate",
    "validator.publish_verdict",
    "trainer.verdict_delivery",
)
"""The stages between an inferer's publish and the trainer holding the verdict."""


def busy_share(training: dict[str, Any]) -> float | None:
    """train / (train + waiting + write + share) from a trainer status without its own ``busy_share``
    (before issue 38; start-up included, so a slight underestimate)."""
    times = training.get("time_s", {})
    total = sum(float(times.get(k, 0.0)) for k in ("train_s", "waiting_s", "write_s", "share_s"))
    return round(float(times.get("train_s", 0.0)) / total, 3) if total > 0 else None


def round_trip(snapshots: dict[str, Any]) -> dict[str, float]:
    """Mean seconds per batch for every stage as ``role.stage``, averaged over the nodes of each role."""
    found: dict[str, list[float]] = {}
    for name, snapshot in snapshots.items():
        if not snapshot or name == "adversary":
            continue
        role = "trainer" if name == "trainer" else name.split("-")[0]
        section_name, wanted = STAGES.get(role, ("", ()))
        sections = snapshot.get("sections", {})
        stages: dict[str, Any] = dict(sections.get(section_name, {}).get("stages", {}))
        if role == "trainer":  # admission reports its own stages inside the training section
            stages.update(sections.get("training", {}).get("admission_stages", {}))
        for stage in wanted:
            if stage in stages and stages[stage]["count"]:
                found.setdefault(f"{role}.{stage}", []).append(float(stages[stage]["mean_s"]))
    return {stage: round(statistics.fmean(values), 4) for stage, values in found.items()}


def _median(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300, help="trainer steps (the demo's default)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--adversary", default="forged_proof")
    parser.add_argument(
        "--confined",
        action="store_true",
        help="pin the swarm's trainer to one core and every other demo process to another (taskset)",
    )
    args = parser.parse_args()

    from prime_node.demo.orchestrator import make_model

    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="prime-node-swarm-learning-"))
    model_dir = work / "model"
    make_model(model_dir, lambda line: print(line, file=sys.stderr))
    local: list[dict[str, Any]] = []
    swarm: list[dict[str, Any]] = []
    for seed in args.seeds:
        local.append(local_run(model_dir, work, args.steps, seed))
        print(f"seed {seed} local: {json.dumps(local[-1])}", file=sys.stderr)
        swarm.append(swarm_run(model_dir, work, args.steps, seed, args.adversary, confined=args.confined))
        print(f"seed {seed} swarm: {json.dumps(swarm[-1])}", file=sys.stderr)
    local_rate = statistics.median(r["steps_per_s"] for r in local)
    swarm_rate = statistics.median(r["steps_per_s"] for r in swarm)
    gain_local = statistics.fmean(r["gain"] for r in local)
    gain_swarm = statistics.fmean(r["gain"] for r in swarm)
    stages = sorted({stage for r in swarm for stage in r["round_trip_s"]})
    result = {
        "benchmark": "swarm_learning",
        "steps": args.steps,
        "seeds": args.seeds,
        "steps_per_s_local": round(local_rate, 3),
        "steps_per_s_swarm": round(swarm_rate, 3),
        "steps_per_s_ratio": round(swarm_rate / local_rate, 3) if local_rate else None,
        "gain_local_at_equal_steps": round(gain_local, 4),
        "gain_swarm": round(gain_swarm, 4),
        "parity": round(gain_swarm / gain_local, 3) if gain_local > 0 else None,
        "parity_by_seed": [
            round(s["gain"] / lo["gain"], 3) if lo["gain"] > 0 else None
            for s, lo in zip(swarm, local, strict=True)
        ],
        "gain_local_by_seed": [r["gain"] for r in local],
        "gain_swarm_by_seed": [r["gain"] for r in swarm],
        "steps_per_s_local_by_seed": [r["steps_per_s"] for r in local],
        "steps_per_s_swarm_by_seed": [r["steps_per_s"] for r in swarm],
        "round_trip_s": {
            stage: round(statistics.fmean(r["round_trip_s"].get(stage, 0.0) for r in swarm), 4)
            for stage in stages
        },
        "round_trip_order": [f"{role}.{stage}" for role, (_, names) in STAGES.items() for stage in names],
        "swarm_stale_batches": [r["stale"] for r in swarm],
        "swarm_produced_batches": [r["produced"] for r in swarm],
        "stale_share": round(sum(r["stale"] for r in swarm) / max(1, sum(r["produced"] for r in swarm)), 4),
        "stale_share_by_seed": [round(r["stale"] / max(1, r["produced"]), 4) for r in swarm],
        "busy_share": _median([r["busy_share"] for r in swarm]),
        "busy_share_by_seed": [r["busy_share"] for r in swarm],
        "verdict_round_trip_s": round(statistics.fmean(r["verdict_round_trip_s"] for r in swarm), 4),
        "confined": args.confined,
        "demand_by_seed": [r["demand"] for r in swarm],
        "stale_kinds_by_seed": [
            {
                "stale": r["stale"] - r["stale_in_queue"],
                "stale_in_queue": r["stale_in_queue"],
                "below_floor": r["below_floor"],
            }
            for r in swarm
        ],
        "ages_by_seed": [r["ages"] for r in swarm],
        "train_slowdown": _median(
            [
                s["train_s_per_step"] * lo["steps_per_s"] if s["train_s_per_step"] else None
                for s, lo in zip(swarm, local, strict=True)
            ]
        ),
        "trainer_time_s_by_seed": [r["time_s"] for r in swarm],
        "swarm_wall_s": [r["wall_s"] for r in swarm],
        "local_wall_s": [r["wall_s"] for r in local],
        "adversary": args.adversary,
        "adversary_accepted": [r["adversary_accepted"] for r in swarm],
        "cores": os.cpu_count(),
        "loadavg_before": round(load_before, 2),
        "loadavg_after": round(os.getloadavg()[0], 2),
        "total_s": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
