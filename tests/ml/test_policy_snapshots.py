"""Issue 32: no policy the trainer keeps, hands to a writer or publishes shares storage with the live
parameters, and the model is built on the meta device with each rank reading only its own rows.

At world size 1 on CPU a full-state-dict gather returns the parameters' own storage (shown below), so
a "snapshot" taken that way silently follows every later optimizer step. Each check here takes the
snapshot, changes the parameters (optimizer steps, or an in-place edit), and looks at the snapshot
again: in this process at world size 1, and under torchrun with 2 gloo ranks (this file is the worker:
``python -m torch.distributed.run --nproc_per_node=2 tests/ml/test_policy_snapshots.py --worker ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.ml.checkpoint import model_weights, read_weights, step_dir
from prime_node.ml.distributed import DistInfo
from prime_node.ml.fsdp import (
    build_sharded_model,
    full_weights,
    sharded_copy,
    training_mesh,
    write_safetensors_shards,
)
from prime_node.ml.model import load_model, weight_files
from prime_node.ml.prepared import Prepared
from prime_node.ml.session import TrainingSession
from prime_node.ml.tokenizer import load_tokenizer
from prime_node.ml.trainer import GRPOTrainer

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5
"""For data that is only moved (snapshots, files): any gap is a wrong copy; an optimizer step at lr
1e-2 moves weights by ~1e-2, three orders of magnitude above it."""


def _prepared(vocab: int, samples: int = 6, seed: int = 3) -> Prepared:
    """Random completions of policy 0 after a fixed prompt, random advantages and behaviour log-probs:
    a real gradient (nothing here needs the task)."""
    generator = torch.Generator().manual_seed(seed)
    prompt = [5, 6, 7, 8]
    sequences, behaviour = [], []
    for _ in range(samples):
        length = int(torch.randint(1, 6, (1,), generator=generator))
        sequences.append(prompt + torch.randint(3, vocab, (length,), generator=generator).tolist())
        behaviour.append((-2.0 - torch.rand(length, generator=generator, dtype=torch.float64)).tolist())
    advantages = torch.randn(samples, generator=generator, dtype=torch.float64).tolist()
    return Prepared(0, sequences, [len(prompt)] * samples, advantages, 0.25, samples // 4, 1, behaviour)


def _config(out: Path, model_dir: Path, **extra: object) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model_dir": str(model_dir),
            "output_dir": str(out),
            "max_new_tokens": 6,
            "micro_batch_samples": 3,
            "grad_clip": 1e9,
            "learning_rate": 1e-2,
            **extra,
        }
    )


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _live_storages(model: Any) -> set[int]:
    return {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=ids, use_cache=False).logits
    return logits.float()


def scenario(model_dir: Path, out: Path, dist: DistInfo) -> dict[str, float]:
    """Every rank: a "recompute" training session (policies published in bf16) through two optimizer
    steps on batches of policy 0, with snapshots taken before each change. Rank 0 returns the gaps."""
    tokenizer = load_tokenizer(model_dir)
    session = TrainingSession(
        _config(out, model_dir, objective="recompute", publish_dtype="bfloat16", async_level=2),
        base=model_dir,
        dist=dist,
    )
    trainer = session.trainer
    model = trainer.model
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    ids = torch.tensor([_prepared(len(tokenizer)).sequences[0]])
    logits_0 = _logits(model, ids)  # collective forward of policy 0

    start = full_weights(model)
    aliased = sum(t.untyped_storage().data_ptr() in _live_storages(model) for t in start.values())
    # An in-place edit after the snapshot (on a frozen copy: the session trains on).
    frozen = sharded_copy(model)
    snapshot = full_weights(frozen)
    kept = {name: tensor.clone() for name, tensor in snapshot.items()}
    with torch.no_grad():
        for param in frozen.parameters():
            param.to_local().add_(1.0)
    edited = full_weights(frozen)

    after: dict[int, dict[str, torch.Tensor]] = {}

    def snap(_: object = None) -> None:  # collective: rank 0 after train(), the others in follow()
        after[session.step] = full_weights(model)

    prepared = _prepared(len(tokenizer))
    if dist.is_main:
        for _ in range(2):
            session.train([prepared])  # staleness 0, then 1: the second recomputes policy 0
            snap()
        session.close()
    else:
        session.follow(snap)
        session.close()
    trainer.history.load_into(0, trainer._old_model)  # what "recompute" uses for policy 0
    old = full_weights(trainer._old_model)
    old_logits = _logits(trainer._old_model, ids)
    now_logits = _logits(model, ids)
    if not dist.is_main:
        return {}
    root = out / "checkpoints"
    staged_bf16 = read_weights(session.staging, "step_00000002.bfloat16.safetensors")

    def published(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(torch.bfloat16) for k, v in weights.items()}

    checkpoints = [read_weights(step_dir(root, k)) for k in (0, 1, 2)]
    return {
        "local_fraction": local / total,
        "aliased": float(aliased),
        "edit_snapshot_gap": _gap(snapshot, kept),
        "edit_moved": _gap(edited, kept),
        "history_gap": _gap(old, start),
        "history_logits_gap": float((old_logits - logits_0).abs().max()),
        "trained_logits_moved": float((now_logits - logits_0).abs().max()),
        # The checkpoints hold the policies as published (bf16 here): the one file the ranks wrote.
        "checkpoint_1_gap": _gap(checkpoints[1], published(after[1])),
        "checkpoint_2_gap": _gap(checkpoints[2], published(after[2])),
        "steps_moved": _gap(after[2], after[1]),
        "checkpoint_0_gap": _gap(checkpoints[0], published(start)),
        "checkpoint_dtypes_ok": float(
            all(t.dtype == torch.bfloat16 for c in checkpoints for t in c.values())
        ),
        "transformers_load_gap": _gap(model_weights(load_model(step_dir(root, 2))), published(after[2])),
        "bf16_file_gap": _gap(staged_bf16, {k: v.to(torch.bfloat16) for k, v in after[2].items()}),
        "bf16_dtypes_ok": float(all(t.dtype == torch.bfloat16 for t in staged_bf16.values())),
    }


def _check(result: dict[str, float], world_size: int) -> None:
    assert result["aliased"] == 0  # full_weights: no tensor is a live parameter's storage
    assert result["edit_snapshot_gap"] == 0 and result["edit_moved"] > 0.5
    assert result["steps_moved"] > 1e-3  # the optimizer really moved the weights between the steps
    gaps = (
        "history_gap",
        "checkpoint_0_gap",
        "checkpoint_1_gap",
        "checkpoint_2_gap",
        "transformers_load_gap",
    )
    for key in gaps:
        assert result[key] < TOLERANCE, key
    # The old policy's forward is policy 0's (same shards, same kernels), the trained one moved.
    assert result["history_logits_gap"] < TOLERANCE < 1e-3 < result["trained_logits_moved"]
    assert result["bf16_dtypes_ok"] == 1 and result["bf16_file_gap"] == 0
    assert result["checkpoint_dtypes_ok"] == 1  # no float32 copy is written per step
    # Each rank holds its own rows only (plus at most one row per tensor from uneven chunks).
    assert result["local_fraction"] <= 1 / world_size + 0.02


def test_a_world_size_1_gather_alone_aliases_the_parameters(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Why ``full_weights`` checks storage: torch's own full-state-dict gather (the old code path)
    returns the live parameters at world size 1; ``full_weights`` never does."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    trainer = GRPOTrainer(
        _config(tmp_path, tiny_model_dir),
        load_model(tiny_model_dir),
        load_tokenizer(tiny_model_dir),
        checkpoint_root=tmp_path / "checkpoints",
        dist=DistInfo(),
    )
    live = _live_storages(trainer.model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    plain = get_model_state_dict(trainer.model, options=options)
    assert any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in live for t in plain.values())
    snapshot = full_weights(trainer.model)
    assert not any(t.untyped_storage().data_ptr() in live for t in snapshot.values())
    kept = {name: tensor.clone() for name, tensor in snapshot.items()}
    trainer.train_step(_prepared(len(trainer.tokenizer)))  # an optimizer step after the snapshot
    assert _gap(snapshot, kept) == 0
    assert _gap(full_weights(trainer.model), kept) > 1e-3


def test_snapshots_survive_parameter_changes_at_world_size_1(tiny_model_dir: Path, tmp_path: Path) -> None:
    _check(scenario(tiny_model_dir, tmp_path / "out", DistInfo()), world_size=1)


@pytest.mark.slow  # torchrun and two ranks loading torch: ~30 s on a quiet 2-core machine
def test_snapshots_survive_parameter_changes_at_world_size_2(tiny_model_dir: Path, tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(Path(__file__).resolve()),
        *("--worker", "--model", str(tiny_model_dir), "--out", str(tmp_path / "out")),
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _check(json.loads((tmp_path / "out" / "result.json").read_text()), world_size=2)


def test_a_reference_model_exists_only_for_a_kl_term_and_is_its_own_copy(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    def trainer(**extra: object) -> GRPOTrainer:
        return GRPOTrainer(
            _config(tmp_path, tiny_model_dir, **extra),
            load_model(tiny_model_dir),
            load_tokenizer(tiny_model_dir),
            checkpoint_root=tmp_path / "checkpoints",
            dist=DistInfo(),
        )

    plain = trainer()
    assert plain._reference is None and plain._old_model is None and plain.history.steps() == []
    with_kl = trainer(kl_coef=0.1)
    reference = with_kl._reference
    assert reference is not None
    assert not _live_storages(reference) & _live_storages(with_kl.model)
    before = full_weights(reference)
    assert _gap(before, full_weights(with_kl.model)) == 0
    with_kl.train_step(_prepared(len(with_kl.tokenizer)))
    assert _gap(full_weights(reference), before) == 0  # the reference stays the starting policy


def _untied_model_dir(out: Path) -> Path:
    """A tiny Qwen2 whose output head is its own parameter (as in Qwen3-8B and larger)."""
    from transformers import Qwen2ForCausalLM

    from prime_node.ml.model import save_model_dir, tiny_config
    from prime_node.ml.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = tiny_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    config.tie_word_embeddings = False
    torch.manual_seed(5)
    save_model_dir(Qwen2ForCausalLM(config), tokenizer, out)
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_a_model_built_on_the_meta_device_is_the_model_on_disk(
    tiny_model_dir: Path, tmp_path: Path, tied: bool
) -> None:
    """Built without memory, sharded, then filled from the file: the same weights, buffers (rotary
    frequencies are not in the file) and forward pass as transformers' own loading."""
    model_dir = tiny_model_dir if tied else _untied_model_dir(tmp_path / "untied")
    reference = load_model(model_dir)
    built = build_sharded_model(model_dir, training_mesh(DistInfo(), "cpu"), device="cpu")
    assert (built.lm_head.weight is built.model.embed_tokens.weight) == tied
    assert _gap(full_weights(built), model_weights(reference)) == 0
    ids = torch.tensor([[3, 9, 12, 20, 7]])
    assert float((_logits(built, ids) - _logits(reference, ids)).abs().max()) < TOLERANCE
    # What every rank writes back is the same file content again (tied head left out).
    write_safetensors_shards(built, tmp_path / "again.safetensors")
    assert _gap(read_weights(tmp_path, "again.safetensors"), model_weights(reference)) == 0
    assert ("lm_head.weight" in read_weights(tmp_path, "again.safetensors")) != tied


def test_a_policy_file_that_cannot_be_written_is_a_node_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    built = build_sharded_model(tiny_model_dir, training_mesh(DistInfo(), "cpu"), device="cpu")
    (tmp_path / "a_file").write_text("not a directory")
    with pytest.raises(NodeError) as info:
        write_safetensors_shards(built, tmp_path / "a_file" / "policy.safetensors")
    assert info.value.reason == "checkpoint_failed"


def _broken_weights(tiny_model_dir: Path, out: Path, kind: str) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    if kind == "missing":
        del weights[name]
    elif kind == "shape":
        weights[name] = weights[name][:-1].clone()
    elif kind == "dtype":
        weights[name] = torch.zeros(weights[name].shape, dtype=torch.int32)
    if kind == "truncated":
        data = (out / "model.safetensors").read_bytes()
        (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif kind == "index":
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {name: "../../etc/passwd.safetensors"}})
        )
    else:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("kind", ["missing", "shape", "dtype", "truncated", "index"])
def test_weights_that_do_not_fit_the_model_are_refused(
    tiny_model_dir: Path, tmp_path: Path, kind: str
) -> None:
    model_dir = _broken_weights(tiny_model_dir, tmp_path / kind, kind)
    with pytest.raises(NodeError) as info:
        weight_files(model_dir)
        build_sharded_model(model_dir, training_mesh(DistInfo(), "cpu"), device="cpu")
    assert info.value.reason == "bad_model_dir"


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from prime_node.ml.distributed import init_from_env, shutdown

    torch.set_num_threads(1)
    dist = init_from_env()
    try:
        result = scenario(args.model, args.out, dist)
    except BaseException:
        shutdown(together=False)
        raise
    shutdown()
    if dist.is_main:
        (args.out / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    from prime_node.ml.distributed import exit_process

    exit_process(_worker(sys.argv[1:]))
