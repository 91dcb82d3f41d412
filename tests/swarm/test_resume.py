"""Kill a real fetcher process with SIGKILL mid-download; the re-run resumes from the verified pieces."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from crypto.keys import WalletKey
from prime_node.swarm.checkpoint_pieces import build_checkpoint
from prime_node.testing.swarm_fixtures import read_tree, write_model_dir
from protocol.codec import encode

WORKER = Path(__file__).with_name("resume_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def start(args: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_sigkill_mid_download_then_resume(tmp_path: Path) -> None:
    key = WalletKey.generate()
    source = write_model_dir(tmp_path / "model", weight_bytes=200_000)
    shared = build_checkpoint(
        source, key, run="demo", step=4, now_ms=int(time.time() * 1000), piece_size=4096
    )
    envelope = tmp_path / "manifest.envelope"
    envelope.write_bytes(encode(shared.envelope))
    out = tmp_path / "out"
    args = [str(source), str(tmp_path / "store"), str(envelope), str(key.address), str(out)]
    count = shared.manifest.piece_count
    assert count > 30

    first = start([*args, "0.05"])
    assert first.stdout is not None
    lines: list[str] = []
    while len([x for x in lines if x.startswith("wrote")]) < 10:
        line = first.stdout.readline()
        assert line, f"worker ended early: {first.stderr.read() if first.stderr else ''}"
        lines.append(line.strip())
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL
    assert not out.exists()  # killed before the end: no output directory, not even a partial one
    written_before = {int(x.split()[1]) for x in lines if x.startswith("wrote")}

    second = start([*args, "0"])
    stdout, stderr = second.communicate(timeout=120)
    assert second.returncode == 0, stderr
    report = stdout.split("\n")
    resumed_with = int(report[0].split()[1])
    assert resumed_with >= len(written_before)  # everything written before the kill was kept
    written_after = {int(x.split()[1]) for x in report if x.startswith("wrote")}
    assert not written_after & written_before, "re-fetched pieces that were already verified"
    assert len(written_after) == count - resumed_with
    assert read_tree(out) == read_tree(source)
