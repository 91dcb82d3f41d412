from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from crypto.keys import Address
from prime_node.ml.checkpoint import (
    POLICY_FILES,
    list_checkpoints,
    load_optimizer_state,
    prune_checkpoints,
    prune_step_dirs,
    read_weights,
    save_checkpoint,
    weights_dtype,
    write_checkpoint,
    write_policy_dir,
)
from prime_node.ml.model import load_model
from prime_node.ml.rollout_log import RolloutLog
from protocol.codec import encode
from protocol.rollouts import RolloutBatch, RolloutSample, pack_logprobs, pack_tokens


def _trained_a_little(model_dir: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = load_model(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        loss = model(input_ids=torch.randint(0, 50, (2, 6)), labels=torch.randint(0, 50, (2, 6))).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer


def test_checkpoint_is_a_loadable_hf_dir_with_exact_weights_and_optimizer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model, optimizer = _trained_a_little(tiny_model_dir)
    checkpoint = save_checkpoint(tmp_path, 7, model, optimizer, tiny_model_dir, {"run_id": "t"})
    assert checkpoint.path.name == "step_00000007"
    assert sorted(p.suffix for p in checkpoint.path.iterdir() if p.suffix in {".bin", ".pt", ".pkl"}) == []
    loaded = load_model(checkpoint.path)  # transformers itself reads our files
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    fresh = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    load_optimizer_state(fresh, checkpoint.path / "optimizer.safetensors")
    before, after = optimizer.state_dict()["state"], fresh.state_dict()["state"]
    assert sorted(before) == sorted(after)
    for key in before:
        a, b = before[key], after[key]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        assert float(a["step"]) == float(b["step"])
    assert fresh.param_groups[0]["lr"] == 1e-2


def test_unfinished_checkpoints_are_ignored_and_old_ones_pruned(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, optimizer = _trained_a_little(tiny_model_dir)
    for step in range(4):
        save_checkpoint(tmp_path, step, model, optimizer, tiny_model_dir, {})
    (tmp_path / "step_00000009.tmp").mkdir()  # a kill mid-write
    assert [c.step for c in list_checkpoints(tmp_path)] == [0, 1, 2, 3]
    prune_checkpoints(tmp_path, 2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 3]
    assert "model.embed_tokens.weight" in read_weights(tmp_path / "step_00000003")


def _batch(counter: int) -> RolloutBatch:
    sample = RolloutSample(
        task_id=1,
        seed=2,
        prompt=pack_tokens([3, 4]),
        completion=pack_tokens([5, 1]),
        logprobs=pack_logprobs([-0.5, -0.1]),
        finished=True,
        proof=b"",
    )
    return RolloutBatch(1, "demo", Address(b"\x01" * 20), 0, counter, 1.0, 2, (sample, sample))


def test_rollout_log_survives_a_torn_tail_and_keeps_every_whole_record(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.log"
    log = RolloutLog(path)
    for step in range(3):
        log.append(step, encode(_batch(step)))
    whole = path.stat().st_size
    with open(path, "ab") as handle:
        handle.write(b"PNRL\x00\x00\x01\x00garbage")  # a kill in the middle of an append
    reopened = RolloutLog(path)
    assert len(reopened) == 3 and path.stat().st_size == whole
    assert sorted(reopened.batches_from(1)) == [1, 2]
    assert reopened.batches_from(0)[2].batch_counter == 2
    assert reopened.compact(1) == 1 and len(RolloutLog(path)) == 2
    assert sorted(RolloutLog(path).batches_from(0)) == [1, 2]
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # corrupt the last record's frame: its digest no longer matches
    path.write_bytes(bytes(raw))
    assert len(RolloutLog(path)) == 1


def test_the_shared_policy_and_its_checkpoint_are_one_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    """One write per policy: the checkpoint and the shared directory hard-link the same weights file,
    which keeps its bytes whichever directory is pruned first."""
    staged = tmp_path / "staged.safetensors"
    save_file({"w": torch.arange(6, dtype=torch.bfloat16)}, str(staged))
    checkpoint = write_checkpoint(tmp_path / "checkpoints", 3, staged, None, tiny_model_dir, {"run_id": "r"})
    policy = write_policy_dir(tmp_path / "policies", 3, staged, tiny_model_dir)
    inode = staged.stat().st_ino
    assert (checkpoint.path / "model.safetensors").stat().st_ino == inode
    assert (policy / "model.safetensors").stat().st_ino == inode
    assert not (policy / "trainer_state.json").exists()  # nothing private in what peers fetch
    assert {p.name for p in policy.iterdir()} <= {*POLICY_FILES, "model.safetensors"}
    assert weights_dtype(policy / "model.safetensors") == "bfloat16"
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(6)}, str(other))
    assert write_policy_dir(tmp_path / "policies", 3, other, tiny_model_dir) == policy  # kept as it was
    assert (policy / "model.safetensors").stat().st_ino == inode
    for step in (4, 5, 6):
        write_policy_dir(tmp_path / "policies", step, other, tiny_model_dir)
    prune_step_dirs(tmp_path / "policies", 6, 2)
    assert sorted(p.name for p in (tmp_path / "policies").iterdir()) == ["step_00000005", "step_00000006"]
    assert torch.equal(read_weights(checkpoint.path)["w"], torch.arange(6, dtype=torch.bfloat16))


@given(st.binary(max_size=200))
def test_a_weights_file_of_any_bytes_has_a_dtype_or_none(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        path.write_bytes(data)
        assert weights_dtype(path) in (None, "float32", "bfloat16", "float16", "float64")
    header = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        path.write_bytes(len(header).to_bytes(8, "little") + header + data[:4].ljust(4, b"\0"))
        assert weights_dtype(path) == "float32"
