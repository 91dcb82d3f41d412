"""What a user runs, under a connection flood: a real ``prime-node share`` process whose libp2p port holds
300 idle or half-finished Noise connections still serves a real ``prime-node fetch`` process, which
writes byte-identical files (issue 13, item 6: before the fix every fetch failed with "no bootstrap peer
reachable within 30 s")."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from prime_node.testing.swarm_fixtures import read_tree, write_model_dir
from tests import warm_cli
from tests.p2p.test_inbound_flood import FloodStats, flood

NET = ["--listen", "/ip4/127.0.0.1/tcp/0", "--dataplane-host", "127.0.0.1", "--heartbeat-interval", "0.5"]
WALLET = ["--new-wallet", "--no-password", "--light-kdf"]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prime_node", *args]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["idle", "half"])
async def test_a_real_fetch_completes_while_the_sharing_process_is_flooded(tmp_path: Path, mode: str) -> None:
    model = write_model_dir(tmp_path / "model", weight_bytes=2 << 20, shards=2)
    share = warm_cli.popen(
        _cli("share", str(model), "--step", "3", "--json", "--data-dir", str(tmp_path / "origin"),
             "--piece-size", "65536", *NET, *WALLET),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert share.stdout is not None
        line = await trio.to_thread.run_sync(share.stdout.readline)
        assert line, share.stderr.read() if share.stderr else ""
        shared = json.loads(line)
        boot = str(shared["multiaddrs"][0])
        port = int(boot.split("/tcp/")[1].split("/", maxsplit=1)[0])
        stats = FloodStats()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood, port, ["127.0.9.1"], mode, stats)
            await trio.sleep(3)  # the flood holds its connections before the fetch starts
            fetch = _cli(
                "fetch", str(shared["manifest_id"]), "--out", str(tmp_path / "out"), "--bootstrap", boot,
                "--trainer", str(shared["trainer"]), "--data-dir", str(tmp_path / "fetcher"),
                *NET, *WALLET, "--json",
            )  # fmt: skip
            done = await trio.to_thread.run_sync(
                functools.partial(warm_cli.run, fetch, capture_output=True, timeout=120)
            )
            nursery.cancel_scope.cancel()
        assert stats.opened >= 300, stats  # the flood really ran
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        assert read_tree(tmp_path / "out") == read_tree(model)
    finally:
        share.send_signal(signal.SIGTERM)
        try:
            share.wait(timeout=15)
        finally:
            if share.poll() is None:
                share.kill()
