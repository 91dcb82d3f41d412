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
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.verification.policy_flood import RATE_HZ, run_demo  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rate", type=float, default=RATE_HZ, help="attacker frames per second")
    parser.add_argument("--timeout", type=float, default=150.0, help="per demo run, seconds")
    args = parser.parse_args()
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
