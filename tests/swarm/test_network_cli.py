"""``prime-node share`` / ``prime-node fetch`` as real processes on 127.0.0.1: byte-identical output, the
failure lines, and a fetcher killed with SIGKILL that resumes from its verified pieces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crypto.keys import WalletKey
from prime_node.testing.swarm_fixtures import read_tree, write_model_dir
from protocol.swarm.pieceset import from_wire
from tests import warm_cli

NET = ["--listen", "/ip4/127.0.0.1/tcp/0", "--dataplane-host", "127.0.0.1", "--heartbeat-interval", "0.5"]
WALLET = ["--new-wallet", "--no-password", "--light-kdf"]


def run(command: list[str], **options: Any) -> subprocess.CompletedProcess[str]:
    return warm_cli.run(command, check=False, capture_output=True, text=True, **options)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prime_node", *args]


def fetch(tmp: Path, name: str, mid: str, share: dict[str, object], *extra: str) -> list[str]:
    boot = share["multiaddrs"][0]  # type: ignore[index]
    return cli(
        "fetch", mid, "--out", str(tmp / name), "--bootstrap", str(boot),
        "--data-dir", str(tmp / f"d-{name}"), *NET, *WALLET, "--json", *extra,
    )  # fmt: skip


@pytest.fixture
def seeder(tmp_path: Path) -> Iterator[tuple[dict[str, object], Path]]:
    model = write_model_dir(tmp_path / "model", weight_bytes=4 << 20, shards=2)
    process = warm_cli.popen(
        cli("share", str(model), "--step", "9", "--json", "--data-dir", str(tmp_path / "origin"),
            "--piece-size", "4096", *NET, *WALLET),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line, process.stderr.read() if process.stderr else ""
        yield json.loads(line), model
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            assert process.wait(timeout=15) == 0
        finally:
            if process.poll() is None:
                process.kill()


@pytest.mark.slow
def test_share_then_fetch_writes_identical_bytes_and_the_failures_are_one_line(
    tmp_path: Path, seeder: tuple[dict[str, object], Path]
) -> None:
    share, model = seeder
    mid = str(share["manifest_id"])
    assert share["step"] == 9 and share["bytes"] == sum(len(b) for b in read_tree(model).values())
    done = run(
        fetch(tmp_path, "out", mid, share, "--trainer", str(share["trainer"])),
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["manifest_id"] == mid and result["step"] == 9 and result["bytes"] == share["bytes"]
    assert read_tree(tmp_path / "out") == read_tree(model)

    # No keystore flag: a throwaway identity, no keystore made or asked for (a fetch signs nothing) ...
    boot = str(share["multiaddrs"][0])  # type: ignore[index]
    anonymous = run(
        cli("fetch", mid, "--out", str(tmp_path / "plain"), "--bootstrap", boot,
            "--data-dir", str(tmp_path / "d-plain"), *NET),
        timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert anonymous.returncode == 0, anonymous.stderr
    assert read_tree(tmp_path / "plain") == read_tree(model)
    assert not (tmp_path / "d-plain" / "keystore.json").exists()
    # ... and --wallet-key insists on the wallet: there is none in that data dir.
    insisted = run(
        cli("fetch", mid, "--out", str(tmp_path / "plain2"), "--bootstrap", boot,
            "--data-dir", str(tmp_path / "d-plain"), *NET, "--wallet-key"),
        timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert insisted.returncode == 1 and "no keystore at" in insisted.stderr.strip().splitlines()[-1]

    # The output exists already: refused before anything is downloaded.
    again = run(fetch(tmp_path, "out", mid, share), timeout=60)
    assert again.returncode == 1 and again.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "already exists" in again.stderr

    # A manifest signed by someone other than the named trainer.
    wrong = str(WalletKey.generate().address)
    refused = run(fetch(tmp_path, "other", mid, share, "--trainer", wrong), timeout=120)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1].startswith("error: refusing checkpoint")
    assert not (tmp_path / "other").exists()

    # An id nobody has.
    missing = run(fetch(tmp_path, "none", "ab" * 32, share, "--timeout", "3"), timeout=120)
    assert missing.returncode == 1
    assert (
        missing.stderr.strip().splitlines()[-1] == f"error: no peer offered manifest {'ab' * 32} within 3 s"
    )

    # --out where no directory can be made (under a regular file).
    (tmp_path / "afile").write_text("x")
    blocked = run(
        cli("fetch", mid, "--out", str(tmp_path / "afile" / "out"), *NET, *WALLET),
        timeout=60,
    )  # fmt: skip
    assert blocked.returncode == 1
    assert blocked.stderr.strip().splitlines()[-1] == (
        f"error: cannot write --out: {tmp_path / 'afile'} is not a directory"
    )


@pytest.mark.slow
def test_a_fetcher_killed_with_sigkill_resumes_from_its_verified_pieces(
    tmp_path: Path, seeder: tuple[dict[str, object], Path]
) -> None:
    share, model = seeder
    mid = str(share["manifest_id"])
    pieces = int(share["pieces"])  # type: ignore[call-overload]
    command = fetch(tmp_path, "out", mid, share)
    process = warm_cli.popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    progress = tmp_path / "d-out" / "swarm" / "pieces" / mid / "progress"
    held = 0
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if progress.exists():
                try:
                    held = from_wire(progress.read_bytes(), pieces).bit_count()
                except Exception:
                    held = 0
                if held >= pieces // 5:
                    break
            time.sleep(0.02)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    assert 0 < held < pieces, f"the fetcher was not caught mid-transfer ({held} of {pieces})"
    assert not (tmp_path / "out").exists()  # nothing half-written at the target
    rerun = run(command, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    result = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert result["resumed_pieces"] >= held  # these were not downloaded again
    assert read_tree(tmp_path / "out") == read_tree(model)


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_a_rerun_with_room_completes(
    tmp_path: Path, seeder: tuple[dict[str, object], Path]
) -> None:
    """The fetcher's data dir on a 1 MiB tmpfs cannot hold the 4 MiB checkpoint: one clear line, exit 1,
    no --out; the same fetch with room completes byte-identical."""
    share, model = seeder
    mid = str(share["manifest_id"])
    small = tmp_path / "small"
    small.mkdir()
    if run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], timeout=60).returncode != 0:
        pytest.skip("needs permission to mount a small tmpfs")
    try:
        full = run(fetch(small, "out", mid, share), timeout=120)
        assert full.returncode == 1, full.stderr
        assert full.stderr.strip().splitlines()[-1].startswith("error: disk full"), full.stderr
        assert not (small / "out").exists()
    finally:
        run(["umount", "-l", str(small)], timeout=60)
    done = run(fetch(tmp_path, "out", mid, share), timeout=120)
    assert done.returncode == 0, done.stderr
    assert read_tree(tmp_path / "out") == read_tree(model)
