"""Start time of `prime-node --help` and `prime-node --version`, against a bare `python -c pass`.

Prints one JSON line: median wall time of each over several runs, and the ratio to the bare interpreter
measured in the same script (the issue's target: under 1 s).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

RUNS = 7


def median_seconds(argv: list[str]) -> float:
    times = []
    for _ in range(RUNS):
        started = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    bare = median_seconds([sys.executable, "-c", "pass"])
    help_time = median_seconds([sys.executable, "-m", "prime_node", "--help"])
    version_time = median_seconds([sys.executable, "-m", "prime_node", "--version"])
    print(
        json.dumps(
            {
                "benchmark": "startup",
                "bare_python_s": round(bare, 4),
                "help_s": round(help_time, 4),
                "version_s": round(version_time, 4),
                "help_vs_bare_python": round(help_time / bare, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
