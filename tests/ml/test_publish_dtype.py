"""Issue 15: the trainer publishes its policies in the run's publish dtype, not its float32 master weights.

bfloat16 policies are half the bytes on the wire, and consecutive ones are mostly bit-identical (the
update is below bf16's resolution for most values), which is what makes deltas small. The trainer's own
training state must stay float32.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.roles.trainer_service import TrainerOptions, TrainerService
from prime_node.swarm.delta_versions import Published
from protocol.manifest import Manifest, build_manifest


def _service(tmp_path: Path, model: Path, **overrides: object) -> TrainerService:
    key = WalletKey.generate()
    config = RunConfig.model_validate(
        {
            "model_dir": str(model),
            "output_dir": str(tmp_path / "out"),
            "max_steps": 2,
            "group_size": 4,
            "prompts_per_step": 2,
            "max_new_tokens": 6,
            "trainer_address": str(key.address),
            **overrides,
        }
    )
    return TrainerService(
        key=key,
        run_config=config,
        swarm=None,  # type: ignore[arg-type]  # only the policy writer runs here
        admission=None,  # type: ignore[arg-type]
        options=TrainerOptions(evaluate=False),
    )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, torch.bfloat16),  # auto: bfloat16, whatever inferers compute in (float32 by default)
        ({"publish_dtype": "bfloat16"}, torch.bfloat16),
        ({"inference_dtype": "bfloat16", "validator_dtype": "float32"}, torch.bfloat16),
        (
            {"inference_dtype": "bfloat16", "validator_dtype": "float32", "publish_dtype": "float32"},
            torch.float32,
        ),
    ],
)
def test_policies_are_written_in_the_publish_dtype_from_float32_master_weights(
    tmp_path: Path, tiny_model_dir: Path, overrides: dict[str, object], expected: torch.dtype
) -> None:
    """Linked from the session's published-dtype file; and, for a step whose file is gone (a resume
    after staging was pruned), read back and converted: the same bytes either way."""
    service = _service(tmp_path, tiny_model_dir, **overrides)
    service.session = service._open()
    try:
        master = service.session.weights(0)
        linked = load_file(str(service._write_policy(0) / "model.safetensors"))
        shutil.rmtree(tmp_path / "out" / "policies")

        def gone(step: int) -> Path:
            raise NodeError(f"policy step {step} has no file any more", reason="missing_policy")

        service.session.policy_file = gone  # type: ignore[method-assign]
        converted = load_file(str(service._write_policy(0) / "model.safetensors"))
    finally:
        service.close()
    for written in (linked, converted):
        assert set(written) == set(master)
        for name, tensor in master.items():
            assert tensor.dtype == torch.float32, name  # the trainer's own copy is untouched
            assert written[name].dtype == expected, name
            assert torch.equal(written[name], tensor.to(expected)), name


class _RecordingSwarm:
    """Records what the trainer asks the swarm to publish (the swarm's own behaviour is tested in
    tests/swarm/test_delta_swarm.py with real nodes)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, Path | None, bool, float]] = []

    async def publish(
        self,
        directory: Path,
        *,
        step: int,
        delta_base: Path | None = None,
        snapshot: bool = False,
        max_delta_share: float = 0.5,
    ) -> Published:
        self.calls.append((step, delta_base, snapshot, max_delta_share))
        full = _manifest(step)
        delta = None if snapshot else _manifest(step)
        reason = "snapshot" if snapshot else "delta"
        return Published(
            full=full, delta=delta, full_bytes=1000, delta_bytes=10, encode_seconds=0.0, reason=reason
        )


def _manifest(step: int) -> Manifest:
    key = WalletKey.generate()
    return build_manifest(
        run="run", step=step, piece_size=1024, files=[("a", 1)], piece_hashes=b"\0" * 32, signer=key.address
    )


async def test_the_trainer_publishes_deltas_against_its_previous_policy_and_a_snapshot_every_k_steps(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    service = _service(tmp_path, tiny_model_dir, delta_snapshot_every=3, delta_max_share=0.25)
    swarm = _RecordingSwarm()
    service.swarm = swarm
    directories = [tmp_path / f"policy_{step}" for step in range(7)]
    for step, directory in enumerate(directories):
        await service._share(directory, step)
    assert swarm.calls == [
        (0, None, True, 0.25),  # nothing to diff against yet
        (1, directories[0], False, 0.25),
        (2, directories[1], False, 0.25),
        (3, directories[2], True, 0.25),  # every third step a full snapshot
        (4, directories[3], False, 0.25),
        (5, directories[4], False, 0.25),
        (6, directories[5], True, 0.25),
    ]
    summary = service.status()["publishing"]
    assert (summary["full"], summary["delta"]) == (3, 4)
    assert summary["wire_bytes"] == 3 * 1000 + 4 * 10
    assert summary["wire_bytes_ratio"] == round(3040 / 7000, 4)
