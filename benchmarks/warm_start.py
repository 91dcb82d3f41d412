"""Start of a torch-using prime-node command, cold (a fresh interpreter) against warm (forked from a
warm-start server, prime_node/warm_start).

The command is ``prime-node init-model --arch qwen3 --size tiny --no-warmup``: it imports torch and
transformers, builds a model and writes it, like the start of every node. Runs alternate cold and warm so
that load on a shared machine falls on both alike. Prints one JSON line: median wall seconds of each,
their ratio (cold ÷ warm), and how long the server took to be ready (its imports, paid once per demo or
test session).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prime_node.warm_start.launcher import WarmStart

RUNS = 5


def _command(out: Path) -> list[str]:
    return [sys.executable, "-m", "prime_node", "init-model", "--arch", "qwen3", "--size", "tiny",
            "--no-warmup", "--force", str(out)]  # fmt: skip


def _cold(out: Path) -> float:
    started = time.perf_counter()
    subprocess.run(_command(out), check=True, capture_output=True, timeout=600)
    return time.perf_counter() - started


def _warm(warm: WarmStart, out: Path) -> float:
    started = time.perf_counter()
    process = warm.popen(_command(out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if process is None:
        raise SystemExit(f"the warm-start server declined; its log:\n{warm.log_path.read_text()}")
    _, err = process.communicate(timeout=600)
    if process.returncode != 0:
        raise SystemExit(f"warm init-model failed ({process.returncode}): {err!r}")
    return time.perf_counter() - started


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch, WarmStart() as warm:
        out = Path(scratch) / "model"
        started = time.perf_counter()
        _warm(warm, out)  # the first request waits for the server's imports
        ready_s = time.perf_counter() - started
        cold, hot = [], []
        for _ in range(RUNS):
            cold.append(_cold(out))
            hot.append(_warm(warm, out))
    cold_s, warm_s = statistics.median(cold), statistics.median(hot)
    print(
        json.dumps(
            {
                "benchmark": "warm_start",
                "runs": RUNS,
                "cold_s": round(cold_s, 3),
                "warm_s": round(warm_s, 3),
                "cold_vs_warm": round(cold_s / warm_s, 2),
                "server_ready_s": round(ready_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
