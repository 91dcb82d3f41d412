"""An honest fetch past super-seeding hoarders, against the same fetch without them (issue 13 item 5).

The scenario is tests/swarm/hoarder_scenario.py, on real nodes in this process (libp2p on 127.0.0.1,
data-plane channels): an origin, six hoarders of one kind (SIT: sit on the pieces revealed to them; TAKE:
download and never serve on) and one honest fetcher. The same nodes first fetch a 12 MiB version nobody
hoards (after a warm-up fetch), which is the baseline under the same load; then the hoarders get the
origin's first reveals of another version before the honest peer fetches it. The test of the same
scenario checks what happened (the fetch completes, pieces were opened); this reports how long it took,
which a loaded machine stretches and so belongs here, not in the test. ``REPEATS`` runs per kind; the
median counts (the machine is shared and noisy).

Prints one JSON line: per kind, ``alone_s``, ``hoarded_s`` and ``ratio`` (hoarded / alone, goal <= 1.2 in
docs/security.md) with the pieces opened, and the 1-minute load average before the runs.

    .venv/bin/python benchmarks/hoarders.py
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prime_node.testing.hoarder import HoardMode  # noqa: E402
from tests.swarm.hoarder_scenario import HOARDERS, hoarded_fetch  # noqa: E402

REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))


async def _kind(mode: HoardMode) -> dict[str, Any]:
    runs = []
    for repeat in range(REPEATS):
        with tempfile.TemporaryDirectory(prefix=f"hoarders-{mode.value}-{repeat}-") as tmp:
            runs.append(await hoarded_fetch(Path(tmp), mode))
    if not all(run.alone_identical and run.hoarded_identical for run in runs):
        raise SystemExit(f"{mode.value}: a fetched copy differs from the original")
    ratios = [run.hoarded_s / run.alone_s for run in runs]
    return {
        "alone_s": round(statistics.median(run.alone_s for run in runs), 3),
        "hoarded_s": round(statistics.median(run.hoarded_s for run in runs), 3),
        "ratio": round(statistics.median(ratios), 2),
        "ratios": [round(r, 2) for r in ratios],
        "pieces_opened": [run.pieces_opened for run in runs],
    }


async def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    load = os.getloadavg()[0]
    result: dict[str, Any] = {"benchmark": "hoarders", "hoarders": HOARDERS, "repeats": REPEATS}
    for mode in HoardMode:
        result[mode.value] = await _kind(mode)
    result["load_before"] = round(load, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    trio.run(main)
