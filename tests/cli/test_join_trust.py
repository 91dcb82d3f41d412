"""Issue 13, item 3: a joiner never trusts an unpinned trainer (real ``prime-node join`` processes).

Two trainers announce run ``tofu`` over real libp2p on 127.0.0.1: the honest one and an attacker whose
announcement names a code task file and who also seeds a signed "checkpoint". A joiner started with the
honest trainer's run address follows only it, fetches nothing of the attacker's and shows the conflicting
announcement in ``prime-node status``; a joiner with no pin takes no role, fetches nothing, and says what
to pass, listing both trainers. Before the fix the unpinned joiner trusted whichever announcement it
heard first (trust on first use) and became that trainer's inferer.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.roles.announcement import RunAnnouncer
from prime_node.status.client import fetch_snapshot, resolve_api_url
from prime_node.swarm.service import SwarmService, SwarmSettings
from prime_node.warm_start.process import WarmProcess
from tests import warm_cli
from tests.p2p.helpers import make_config, start_node

CLI = [sys.executable, "-m", "prime_node"]
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("PRIME_NODE_")},
    "PRIME_NODE_LOG_LEVEL": "warning",
}
OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")
RUN = "tofu"
TRAINER = "0x79B1B33BA04F20879BFfB5b089c6f3a3DE75E420"


def _join(data_dir: Path, *extra: str) -> subprocess.Popen[Any] | WarmProcess:
    data_dir.mkdir(parents=True)
    command = [
        *CLI,
        "join",
        "--data-dir",
        str(data_dir),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--heartbeat-interval",
        "1",
        "--new-wallet",
        "--no-password",
        "--light-kdf",
        "--gpu",
        "none",
        "--role",
        "inferer",
        *extra,
    ]
    stderr = (data_dir / "stderr.log").open("w")
    return warm_cli.popen(command, stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=ENV)


def _role(data_dir: Path) -> dict[str, Any]:
    """The joiner's "role" status section, or {} while it is not up yet."""
    if not (data_dir / "node.json").exists():
        return {}
    try:
        sections = fetch_snapshot(resolve_api_url(None, data_dir), timeout=2.0).get("sections", {})
    except Exception:  # not up yet, or between two node.json writes
        return {}
    return dict(sections.get("role") or {})


def _seen(role: dict[str, Any]) -> dict[str, bool]:
    return {row["run"]: row["followed"] for row in role.get("announcements", [])}


@pytest.mark.slow
async def test_only_a_pinned_trainer_is_followed_and_an_unpinned_joiner_takes_no_role(tmp_path: Path) -> None:
    honest, attacker = WalletKey.generate(), WalletKey.generate()
    evil_tasks = tmp_path / "evil" / "tasks.jsonl"
    evil_tasks.parent.mkdir()
    evil_tasks.write_text(json.dumps({"prompt": "p", "tests": "open('/tmp/pwned', 'w')"}) + "\n")
    (evil_tasks.parent / "config.json").write_text("{}")
    (evil_tasks.parent / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    attacker_run = RunConfig.model_validate(
        {"run_id": RUN, "task": {"kind": "code", "path": str(evil_tasks)}}
    )
    attacker_swarm = SwarmService(
        key=attacker,
        run_id=RUN,
        trainer=attacker.address,
        store_dir=tmp_path / "attacker-swarm",
        settings=SwarmSettings(dataplane_host="127.0.0.1"),
    )
    honest_at = f"{RUN}@{honest.address}"
    attacker_at = f"{RUN}@{attacker.address}"
    pinned_dir, unpinned_dir = tmp_path / "pinned", tmp_path / "unpinned"
    processes: list[subprocess.Popen[Any] | WarmProcess] = []
    try:
        with trio.fail_after(150):
            async with trio.open_nursery() as nursery:
                attacker_node, _ = await start_node(
                    nursery,
                    OPEN,
                    make_config(tmp_path, 0, run_id=RUN),
                    key=attacker,
                    services=[
                        attacker_swarm,
                        RunAnnouncer(key=attacker, run_config=attacker_run, period=1.0),
                    ],
                    serve_api=False,
                )
                await attacker_swarm.share(evil_tasks.parent, step=0)
                attacker_boot = attacker_node.advertised_multiaddrs()[0]
                honest_node, _ = await start_node(
                    nursery,
                    OPEN,
                    make_config(tmp_path, 1, run_id=RUN, bootstrap=(attacker_boot,)),
                    key=honest,
                    services=[RunAnnouncer(key=honest, run_config=RunConfig(run_id=RUN), period=1.0)],
                    serve_api=False,
                )
                honest_boot = honest_node.advertised_multiaddrs()[0]
                # The attacker is everyone's first bootstrap peer: it answers first.
                processes.append(
                    _join(pinned_dir, "--bootstrap", attacker_boot, "--run", f"{honest_at},{honest_boot}")
                )
                processes.append(
                    _join(
                        unpinned_dir, "--bootstrap", attacker_boot, "--bootstrap", honest_boot, "--run", RUN
                    )
                )
                both = {honest_at, attacker_at}
                while True:
                    pinned, unpinned = await trio.to_thread.run_sync(
                        lambda: (_role(pinned_dir), _role(unpinned_dir))
                    )
                    for process in processes:
                        assert process.poll() is None, (process.args, process.returncode)
                    assert not unpinned.get("trainer"), f"the unpinned joiner trusts {unpinned['trainer']}"
                    if set(_seen(pinned)) >= both and set(_seen(unpinned)) >= both:
                        break
                    await trio.sleep(0.5)
                await trio.sleep(3)  # time enough to fetch the attacker's checkpoint, if it were followed
                pinned, unpinned = await trio.to_thread.run_sync(
                    lambda: (_role(pinned_dir), _role(unpinned_dir))
                )
                pinned_snapshot = await trio.to_thread.run_sync(
                    lambda: fetch_snapshot(resolve_api_url(None, pinned_dir))
                )
                unpinned_snapshot = await trio.to_thread.run_sync(
                    lambda: fetch_snapshot(resolve_api_url(None, unpinned_dir))
                )
                shown = await trio.to_thread.run_sync(
                    functools.partial(
                        warm_cli.run,
                        [*CLI, "status", "--data-dir", str(pinned_dir), "--once"],
                        stdout=subprocess.PIPE,
                        env={**ENV, "COLUMNS": "200"},
                        timeout=150,
                        check=True,
                    )
                )
                nursery.cancel_scope.cancel()
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)

    # The pinned joiner follows the honest trainer only, and shows the attacker's announcement as refused.
    assert pinned["trainer"] == str(honest.address)
    assert _seen(pinned)[honest_at] is True and _seen(pinned)[attacker_at] is False
    assert "waiting for the first checkpoint" in pinned["reason"]
    status_text = shown.stdout.decode()
    assert f"{attacker_at} not followed" in status_text and f"{honest_at} followed" in status_text
    # The unpinned joiner follows nobody, takes no role and says what to pass, naming both trainers.
    assert unpinned["role"] == "none" and unpinned["trainer"] is None
    assert set(_seen(unpinned).values()) == {False}
    assert "no trainer pinned" in unpinned["reason"] and f"--run {RUN}@0xTRAINER" in unpinned["reason"]
    # Neither fetched the attacker's signed checkpoint.
    for snapshot in (pinned_snapshot, unpinned_snapshot):
        assert not snapshot["sections"].get("checkpoints", {}).get("versions")
    assert not list((unpinned_dir / "swarm").rglob("tasks.jsonl"))
    assert not list((pinned_dir / "swarm").rglob("tasks.jsonl"))
    # What each printed for its operator.
    pinned_err = (pinned_dir / "stderr.log").read_text()
    unpinned_err = (unpinned_dir / "stderr.log").read_text()
    assert f"following trainer {honest.address} (pinned)" in pinned_err
    assert f"{attacker.address} also announces this run" in pinned_err
    assert "following trainer" not in unpinned_err and "trusted on first use" not in unpinned_err
    assert honest_at in unpinned_err and attacker_at in unpinned_err
    assert "Traceback" not in pinned_err + unpinned_err


@pytest.mark.parametrize(
    ("run", "trainer", "fragment"),
    [
        ("tofu@0x1234", None, "not an address"),
        (f"tofu@{TRAINER},ip4/127.0.0.1/tcp/1", None, "not a multiaddr"),
        (f"tofu@{TRAINER}", "0x" + "ab" * 20, "--run names trainer"),
        ("tofu", "0xnope", "--trainer"),
        (f"tofu@{TRAINER},/ip4/127.0.0.1/tcp/1", None, "must end in /p2p/"),  # the node's own check
    ],
)
def test_a_bad_run_address_or_two_different_trainers_is_one_line(
    tmp_path: Path, run: str, trainer: str | None, fragment: str
) -> None:
    args = ["join", "--data-dir", str(tmp_path), "--new-wallet", "--no-password", "--light-kdf", "--run", run]
    if trainer is not None:
        args += ["--trainer", trainer]
    result = warm_cli.run([*CLI, *args], capture_output=True, text=True, env=ENV, timeout=60, check=False)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr
    assert any(line.startswith("error:") and fragment in line for line in lines), result.stderr
    assert not (tmp_path / "node.json").exists()  # refused before the node started
