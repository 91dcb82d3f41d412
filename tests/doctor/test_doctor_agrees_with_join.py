"""``doctor --run ADDR`` takes the role ``join`` would take (issue 36, friction 6): before, the doctor
ignored the run and sized a default 1.5 B bf16 model with CPU inference off ("cannot infer … the run does
not allow CPU inference"), and the same machine then joined as an inferer.

A real trainer node on 127.0.0.1 announces the run (signed) and seeds a tiny model's checkpoint; the
doctor runs in-process with the run address and reports the role and reason; ``RoleRunner._decide``
computes join's first decision from the same hardware, the announced config and the checkpoint's files.
Both go through ``prime_node.roles.choice.decide_role``, so they must match to the character.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.cpu_compute import role_threads
from prime_node.hardware import parse_gpu_selection
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.roles.announcement import RunAnnouncer, announced_config, worker_run_config
from prime_node.roles.role_runner import RoleRunner, measured_profile, requirements_for
from prime_node.swarm.service import SwarmService, SwarmSettings
from protocol.resources import HardwareProfile
from protocol.run_announcement import RunAnnouncement
from tests.cli_in_process import run_cli
from tests.p2p.helpers import make_config, start_node

RUN = "agree"
OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")
PROFILE = HardwareProfile(gpus=(), cpu_cores=2, ram_mib=8192, disk_free_mib=200_000)
DECODE_S_PER_GB = 0.5
"""A CPU fast enough to infer the tiny model in time (what ``measure_cpu_decode`` would measure)."""
SHAPE = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}


def _tiny_model(directory: Path) -> None:
    """A Qwen2-shaped model's config.json and safetensors file (zeros: only the shape matters)."""
    directory.mkdir()
    config = {"model_type": "qwen2", "vocab_size": 64, "intermediate_size": 64, **SHAPE}
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {"embed.weight": [64, 32], "layers.0.q.weight": [32, 32], "layers.1.q.weight": [32, 32]}
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in tensors.items():
        size = shape[0] * shape[1] * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(offset))


def _join_decision(run_config: RunConfig, trainer: WalletKey, model_dir: Path, data_dir: Path) -> Any:
    """join's first decision: RoleRunner.run's profile steps, the announced config, the checkpoint."""
    announcement = RunAnnouncement(
        run_id=RUN,
        trainer=trainer.address,
        config_json=announced_config(run_config, trainer.address),
        issued_at_ms=1,
    )
    config = worker_run_config(announcement, output_dir=data_dir / "run", task_dir=data_dir / "tasks")
    runner = RoleRunner(
        key=WalletKey.generate(),
        run_id=RUN,
        swarm=None,  # type: ignore[arg-type]  # _decide does not touch the swarm
        data_dir=data_dir,
        gpus=parse_gpu_selection("none"),
    )
    threads = role_threads(0)
    runner.config = config
    runner.profile = measured_profile(
        dataclasses.replace(PROFILE, cpu_cores=min(PROFILE.cpu_cores, threads)), config, threads
    )
    context = SimpleNamespace(peers_in=lambda state: [], membership=SimpleNamespace(members=lambda: []))
    return runner._decide(context, requirements_for(config, model_dir))  # type: ignore[arg-type]


async def test_doctor_with_the_run_address_reports_the_role_join_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("prime_node.doctor.checkup.probe", lambda selection, data_dir: PROFILE)
    monkeypatch.setattr("prime_node.roles.role_runner.measure_cpu_decode", lambda *args: DECODE_S_PER_GB)
    trainer = WalletKey.generate()
    model_dir = tmp_path / "model"
    _tiny_model(model_dir)
    run_config = RunConfig.model_validate({"run_id": RUN, "inferer_devices": ["cpu"]})
    swarm = SwarmService(
        key=trainer,
        run_id=RUN,
        trainer=trainer.address,
        store_dir=tmp_path / "trainer-swarm",
        settings=SwarmSettings(dataplane_host="127.0.0.1"),
    )
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            node, _ = await start_node(
                nursery,
                OPEN,
                make_config(tmp_path, 0, run_id=RUN),
                key=trainer,
                services=[swarm, RunAnnouncer(key=trainer, run_config=run_config, period=1.0)],
                serve_api=False,
            )
            await swarm.share(model_dir, step=3)
            address = f"{RUN}@{trainer.address},{node.advertised_multiaddrs()[0]}"
            done = await trio.to_thread.run_sync(
                functools.partial(
                    run_cli,
                    capsys,
                    "doctor",
                    "--run",
                    address,
                    "--json",
                    "--gpu",
                    "none",
                    "--data-dir",
                    str(tmp_path / "doctor"),
                    "--listen",
                    "/ip4/127.0.0.1/tcp/0",
                    "--timeout",
                    "20",
                )
            )
            nursery.cancel_scope.cancel()
    report = json.loads(done.stdout)
    checks = report["checks"]
    assert checks["run"]["status"] == "pass", checks["run"]
    assert checks["run"]["step"] == 3 and checks["run"]["shape_exact"] is True
    assert "config.json" in checks["model"]["value"] and "1.5 B" not in checks["model"]["value"]
    decision = _join_decision(run_config, trainer, model_dir, tmp_path / "join")
    assert decision.role == "inferer"  # the machine of the issue: a CPU that infers this model in time
    assert (checks["role"]["role"], checks["role"]["reason"]) == (decision.role, decision.reason)


async def test_doctor_refuses_a_run_announced_by_another_trainer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run address pins the trainer: another key's announcement is refused (as join refuses it), the
    run check fails with the fix, and the role falls back to the estimate, saying so."""
    announcer, pinned = WalletKey.generate(), WalletKey.generate()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            node, _ = await start_node(
                nursery,
                OPEN,
                make_config(tmp_path, 0, run_id=RUN),
                key=announcer,
                services=[RunAnnouncer(key=announcer, run_config=RunConfig(run_id=RUN), period=1.0)],
                serve_api=False,
            )
            address = f"{RUN}@{pinned.address},{node.advertised_multiaddrs()[0]}"
            args = ("doctor", "--run", address, "--json", "--gpu", "none", "--data-dir", str(tmp_path / "d"))
            done = await trio.to_thread.run_sync(functools.partial(run_cli, capsys, *args))
            nursery.cancel_scope.cancel()
    checks = json.loads(done.stdout)["checks"]
    assert done.returncode == 1
    assert checks["run"]["status"] == "fail" and "refused" in checks["run"]["value"]
    assert checks["run"]["fix"]
    assert checks["model"]["status"] == "fail" and "default estimate" in checks["model"]["value"]
