"""Does one cheap peer still stall training? (issue 13 item 4)

Runs the same short swarm twice, one after the other: ``prime-node demo`` (trainer, one inferer, one
validator as separate processes on 127.0.0.1, real libp2p, no cheating inferer), first alone, then with
an extra identity (joining from this process) that gossips signed rollout frames claiming the step after
the newest one the trainer announced, five a second, from before the first training step to the end
(tests/verification/policy_flood.py). Before the fix the validator waited up to 30 s on each such frame
inside its check loop: in a live demo the trainer went from 1.40 steps/s to 0.

Prints ONE JSON line:
- ``steps_per_s_without``, ``steps_per_s_with``: the trainer's steady-state steps per second (its status,
  from the end of the first step to the last); ``ratio`` = with / without (goal >= 0.9);
- ``steps``, ``flood_sent`` (frames the attacker published), ``attacker_banned`` (by the validator),
  ``validator_with``: the validator's counts in the attacked run (judged, accepted, rejected by reason,
  charged, dropped while waiting for a checkpoint);
- ``attacker_cpu_s``: CPU seconds this process spent (the attacker's node) during the attacked run;
- ``wall_s_without``, ``wall_s_with``, ``load_before``: the 1-minute load average before each run (the
  machine may be shared: compare the two runs, not runs on different days).

``--attack announcements`` (issue 35 item 1) runs the never-resolving-announcement attacker instead, on
real libp2p hosts and real data-plane channels on 127.0.0.1 (tests/verification/network_helpers.py): in
this process a trainer-side intake, one validator (``recompute_groups`` 4) and an honest worker; the
attacker is a node of its own process (benchmarks/flood_support/attacker_peer.py, joined in both runs,
attacking in one), so that its work does not compete with the validator's judging for this process's
GIL. The worker publishes ``--batches`` real-size batches (4,096 samples of up to 400 tokens
from the tiny model, >= 8 MiB each, generated once and sealed afresh for each run) one after the other,
each announced and fetched over the data plane; with the attack, the attacker first gossips 16
announcements of batches at the run's size cap whose data-plane port accepts the channel and never
answers, then 4 more every 2 s for as long as the run lasts. ``--rounds`` pairs of runs (without, with)
are interleaved, each on a fresh swarm, since a shared machine's load drifts; ``--cache DIR`` keeps the
generated batches (~7 min on 2 loaded cores) for the next invocation. Prints ONE JSON line:
``seconds_without``, ``seconds_with`` (each honest batch's time from its announcement to the validator's
verdict), ``ratio`` = mean with / mean without (goal <= 1.2) and ``median_ratio``,
``announce_to_frame_s`` and ``validate_s`` (per run: the validator's mean announcement-to-frame and
judging times, which split the figure into what the attack targets and CPU-bound judging),
``batch_bytes``, ``offers_sent``, ``attacker_cpu_s`` (the attacker process's CPU seconds per attacked
run), and the validator's counts in the last attacked run (refused per worker, undelivered, evicted, stage
times). Run: ``.venv/bin/python benchmarks/validator_flood.py --attack
announcements [--batches 3 --rounds 2 --cache DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.verification.policy_flood import RATE_HZ, run_demo  # noqa: E402

ATTACKER = REPO / "benchmarks" / "flood_support" / "attacker_peer.py"
JOIN_S = 120.0
"""Hang guard for the attacker process to start and join the swarm (seconds; it takes a few)."""


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _one(workdir: Path, *, steps: int, attack: bool, rate_hz: float, timeout_s: float) -> dict[str, Any]:
    load = os.getloadavg()[0]
    began, cpu = time.monotonic(), _cpu_s()
    result = run_demo(workdir, steps=steps, attack=attack, timeout_s=timeout_s, rate_hz=rate_hz)
    result["wall_s"] = round(time.monotonic() - began, 1)
    result["cpu_s"] = round(_cpu_s() - cpu, 2)
    result["load_before"] = round(load, 2)
    if result["returncode"] != 0:
        raise SystemExit(f"demo failed ({result['returncode']}): {result['stderr_tail']}")
    return result


def _honest_batches(scenario: Any, batches: int, cache: Path | None) -> list[Any]:
    """The worker's batches, generated (minutes on 2 cores) or read back from ``cache``."""
    from crypto.keys import WalletKey
    from protocol.codec import decode, encode
    from protocol.rollouts import RolloutBatch

    stored = cache / f"honest-{batches}.bin" if cache is not None else None
    if stored is not None and stored.exists():
        import msgpack

        secret, *items = msgpack.unpackb(stored.read_bytes())
        # The batches name their worker: seal them with the key they were made with, or every honest
        # announcement comes from a node that is not its batch's worker and is dropped unseen.
        scenario.key = WalletKey(secret)
        return [decode(item, RolloutBatch) for item in items]
    honest = [scenario.batch(counter) for counter in range(batches)]
    if stored is not None:
        import msgpack

        stored.parent.mkdir(parents=True, exist_ok=True)
        stored.write_bytes(msgpack.packb([scenario.key.secret, *(encode(batch) for batch in honest)]))
    return honest


NOT_JUDGED_S = 180.0
"""An honest batch not judged this long after its announcement is reported as such (they take 1-25 s)."""


def _ratio(average: Any, with_attack: list[float], without: list[float]) -> float | None:
    """with ÷ without, or None when either side judged no batch (see ``not_judged``)."""
    if not with_attack or not without:
        return None
    return round(float(average(with_attack)) / float(average(without)), 3)


def _counts(status: dict[str, Any]) -> dict[str, Any]:
    """The validator's counters, without its stage timings and transfer detail."""
    return {k: v for k, v in status.items() if isinstance(v, int | float | dict) and k not in ("stages",)}


class _AttackerPeer:
    """The attacker's process (benchmarks/flood_support/attacker_peer.py): commands in, JSON lines out."""

    def __init__(self, process: Any) -> None:
        self.process = process
        self._buffer = b""

    @classmethod
    async def start(cls, settings: dict[str, Any]) -> _AttackerPeer:
        import trio

        argv = [sys.executable, str(ATTACKER), json.dumps(settings)]
        return cls(await trio.lowlevel.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))

    async def expect(self, field: str) -> dict[str, Any]:
        """The next line that carries ``field`` (others are skipped)."""
        import trio

        with trio.fail_after(JOIN_S):
            while True:
                while b"\n" not in self._buffer:
                    chunk = await self.process.stdout.receive_some(4096)
                    if not chunk:
                        raise SystemExit(f"the attacker process ended (status {await self.process.wait()})")
                    self._buffer += chunk
                line, self._buffer = self._buffer.split(b"\n", 1)
                message = json.loads(line)
                if field in message:
                    return dict(message)

    async def send(self, command: str) -> None:
        await self.process.stdin.send_all(command.encode() + b"\n")

    async def close(self) -> None:
        import trio

        with trio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.kill()
            await self.process.wait()


def _announcement_attack(batches: int, rounds: int, cache: Path | None) -> dict[str, Any]:
    """The ``--attack announcements`` benchmark (module doc)."""
    import functools
    import statistics

    import torch
    import trio

    from crypto.keys import WalletKey
    from prime_node.p2p.libp2p_host import open_libp2p_host
    from prime_node.testing.adversary import build_scenario
    from prime_node.verification.batch_publish import publish_frame
    from prime_node.verification.batch_transfer import BatchTransfer
    from prime_node.verification.validator import CheckPolicy
    from protocol.membership import PeerState
    from tests.p2p.helpers import wait_until
    from tests.verification.network_helpers import fresh, judged, start_swarm

    torch.set_num_threads(1)
    validator_key = WalletKey.generate()
    scenario = build_scenario(
        model_seed=2,  # as tests/verification/test_large_batches.py: completions run long
        temperature=0.3,
        group_size=8,
        groups=512,
        max_new_tokens=400,
        trusted_validators=(str(validator_key.address),),
    )
    scenario.current_step = 0
    began = time.monotonic()
    honest = _honest_batches(scenario, batches, cache)
    generate_s = time.monotonic() - began
    opener = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")

    async def honest_batches(nursery: Any, swarm: Any, service: Any, result: dict[str, Any]) -> None:
        """Announce the worker's batches one after the other; each one's announcement-to-verdict time."""
        worker = BatchTransfer(scenario.key, host_of=lambda _: None, host="127.0.0.1")
        await nursery.start(worker.run)
        for batch in honest:
            frame = fresh(scenario).seal(batch)
            result["batch_bytes"] = len(frame)
            announced = time.monotonic()
            batch_id = await publish_frame(swarm.inferer, frame, transfer=worker, inline_limit=0)
            try:
                reasons = await judged(service, batch_id, timeout=NOT_JUDGED_S)
            except AssertionError:  # reported, with the validator's counts, rather than a crash
                result.setdefault("not_judged", []).append(
                    {"batch": batch_id.hex()[:16], "status": _counts(service.status())}
                )
                continue
            result["seconds"].append(round(time.monotonic() - announced, 3))
            result.setdefault("reasons", []).append(list(reasons))

    async def one(root: Path, attack: bool) -> dict[str, Any]:
        result: dict[str, Any] = {"seconds": [], "offers_sent": 0}
        async with trio.open_nursery() as nursery:
            swarm = await start_swarm(
                nursery,
                opener,
                root,
                scenario,
                [validator_key],
                validator_kwargs={0: {"check_policy": CheckPolicy(recompute_groups=4)}},
            )
            validator_node, service = swarm.validators[0]
            # The attacker's process joins both runs (the same swarm either way) and attacks in one.
            attacker = await _AttackerPeer.start(
                {
                    "bootstrap": swarm.trainer.advertised_multiaddrs()[0],
                    "run_config": scenario.config.model_dump(mode="json"),
                    "step": scenario.current_step,
                    "data_dir": str(root / "attacker"),
                    "peers": len(swarm.nodes),
                }
            )
            try:
                peer = (await attacker.expect("peer_id"))["peer_id"]
                await wait_until(
                    lambda: all(peer in node.peers_in(PeerState.HEALTHY) for node in swarm.nodes), JOIN_S
                )
                await attacker.expect("ready")
                await trio.sleep(2)  # let the gossipsub mesh settle after the connections
                if attack:
                    await attacker.send("attack")  # 16 offers at once, then 4 every 2 s
                    await attacker.expect("offered")
                    await trio.sleep(1)
                await honest_batches(nursery, swarm, service, result)
                await attacker.send("stop")
                done = await attacker.expect("offers_sent")
            finally:
                await attacker.close()
            result["offers_sent"], result["attacker_cpu_s"] = done["offers_sent"], done["cpu_s"]
            status = service.status()
            result["fetched_s"] = status["stages"].get("delivery", {}).get("mean_s")
            result["validate_s"] = status["stages"].get("validate", {}).get("mean_s")
            result["validator"] = {
                key: status[key]
                for key in (
                    "validated",
                    "accepted",
                    "refused_worker_fetches",
                    "refused_worker_bytes",
                    "evicted_fetches",
                    "undelivered",
                    "dropped_backlog",
                    "stages",
                )
            }
            result["attacker_score"] = round(validator_node.policy.score(peer), 1)
            result["attacker_banned"] = validator_node.policy.is_banned(peer)
            nursery.cancel_scope.cancel()
        return result

    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    load = []
    with tempfile.TemporaryDirectory(prefix="announcement-flood-") as tmp:
        for round_ in range(rounds):  # interleaved: a shared machine's load drifts between runs
            for attack in (False, True):
                load.append(round(os.getloadavg()[0], 2))
                root = Path(tmp) / f"{round_}-{attack}"
                runs[attack].append(trio.run(one, root, attack))
    without = [s for run in runs[False] for s in run["seconds"]]
    with_attack = [s for run in runs[True] for s in run["seconds"]]
    attacked = runs[True][-1]
    return {
        "attack": "announcements",
        "seconds_without": without,
        "seconds_with": with_attack,
        "ratio": _ratio(statistics.mean, with_attack, without),
        "median_ratio": _ratio(statistics.median, with_attack, without),
        "announce_to_frame_s": {
            "without": [run["fetched_s"] for run in runs[False]],
            "with": [run["fetched_s"] for run in runs[True]],
        },
        "validate_s": {
            "without": [run["validate_s"] for run in runs[False]],
            "with": [run["validate_s"] for run in runs[True]],
        },
        "batch_bytes": attacked["batch_bytes"],
        "batches": batches,
        "rounds": rounds,
        "reasons_with": [run.get("reasons", []) for run in runs[True]],
        "not_judged": {
            "without": [run.get("not_judged", []) for run in runs[False]],
            "with": [run.get("not_judged", []) for run in runs[True]],
        },
        "offers_sent": [run["offers_sent"] for run in runs[True]],
        "attacker_cpu_s": [run["attacker_cpu_s"] for run in runs[True]],
        "attacker_process": "own",
        "validator_with": attacked["validator"],
        "attacker_score": [run["attacker_score"] for run in runs[True]],
        "attacker_banned": [run["attacker_banned"] for run in runs[True]],
        "generate_s": round(generate_s, 1),
        "load_before": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--attack", choices=("policy", "announcements"), default="policy")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rate", type=float, default=RATE_HZ, help="attacker frames per second")
    parser.add_argument("--timeout", type=float, default=150.0, help="per demo run, seconds")
    parser.add_argument("--batches", type=int, default=3, help="--attack announcements: honest batches")
    parser.add_argument("--rounds", type=int, default=2, help="--attack announcements: pairs of runs")
    parser.add_argument(
        "--cache", type=Path, default=None, help="--attack announcements: keep the generated batches here"
    )
    args = parser.parse_args()
    if args.attack == "announcements":
        print(json.dumps(_announcement_attack(args.batches, args.rounds, args.cache)))
        return
    with tempfile.TemporaryDirectory(prefix="validator-flood-") as tmp:
        root = Path(tmp)
        without = _one(
            root / "without", steps=args.steps, attack=False, rate_hz=args.rate, timeout_s=args.timeout
        )
        attacked = _one(
            root / "with", steps=args.steps, attack=True, rate_hz=args.rate, timeout_s=args.timeout
        )
    rate_without = without["status"]["trainer"]["sections"]["training"]["steps_per_s"]
    rate_with = attacked["status"]["trainer"]["sections"]["training"]["steps_per_s"]
    validator = attacked["status"]["validator-1"]
    validation = validator["sections"]["validation"]
    print(
        json.dumps(
            {
                "steps_per_s_without": rate_without,
                "steps_per_s_with": rate_with,
                "ratio": round(rate_with / rate_without, 3) if rate_without else None,
                "steps": args.steps,
                "flood_rate_hz": args.rate,
                "flood_sent": attacked["flood"]["sent"],
                "attacker_banned": attacked["flood"]["peer_id"] in validator["banned"],
                "validator_with": {
                    key: validation.get(key)
                    for key in (
                        "validated",
                        "accepted",
                        "rejected",
                        "charged",
                        "dropped_waiting",
                        "dropped_banned",
                    )
                },
                "honest_accepted_with": attacked["summary"]["accepted_by_worker"].get("inferer-1", 0),
                "attacker_cpu_s": attacked["cpu_s"],
                "wall_s_without": without["wall_s"],
                "wall_s_with": attacked["wall_s"],
                "load_before": [without["load_before"], attacked["load_before"]],
            }
        )
    )


if __name__ == "__main__":
    main()
