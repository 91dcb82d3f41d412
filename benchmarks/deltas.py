"""Delta checkpoints (prime_node/swarm/delta_codec.py): bytes on the wire per step ÷ full checkpoint bytes.

Two real training runs with the project's trainer (``GRPOTrainer.train_step``: GRPO loss, backward, AdamW on
float32 master weights), each publishing every step's policy as the trainer service does (``POLICY_FILES``
copied from the base, ``model.safetensors`` in the publish dtype), and the delta from each published step to
the next encoded, applied and checked byte-identical:

- ``demo``: the demo's packaged tiny model (prime_node/assets) at the demo's own settings (group 8, 16
  prompts, temperature 0.7, learning rate 5e-4, the 2-digit reversed arithmetic task), published in float32
  like the demo. Rollouts are sampled by the current policy and rewarded by the task: every step is a real
  GRPO step. At this rate nearly every value moves, so the delta is dense: ``demo_full_fallback`` says
  whether the trainer would publish a full checkpoint instead (delta > ``MAX_SHARE`` × full).
- ``small``: ``write_model_dir("qwen3", "small", seed)`` (~16M parameters) at ``--lr`` (≤ 1e-5), published
  in bfloat16 (as a bf16 swarm would ship it; float32 beside it for comparison). The untrained model solves
  no task, so every group would be flat (no gradient): as in tests/ml/test_trainer.py, one sample of each
  group has its completion replaced by the right answer before the batch is admitted; the rest of the batch,
  the rewards, the advantages and the step are the project's own.

- ``throughput`` (issue 32): encode and apply speed at Qwen3-0.6B's shape (``write_model_dir("qwen3",
  "0.6b", seed, vocab_size=4096)``: 445M parameters, a 0.89 GB bf16 file). Training it on this machine
  takes minutes a step, so its consecutive policies are made as the trainer makes them, without the
  gradient: float32 master weights (the initial bf16 values, each moved by up to 2^-9 of itself: masters
  sit between bf16 values), each step moved by a uniform ±``--lr`` (Adam's update is about ±lr per weight)
  and published rounded to bf16. ``encode_s_per_gb`` and ``apply_s_per_gb`` are against copying the same
  directory (``shutil.copytree``, page cache) in the same process (``copy_s_per_gb``, ``*_vs_copy``); each
  is the median of ``--repeats`` runs (the machine is shared), with the CPU seconds per GB beside it.
  ``--kernels both`` (the default) times the codec's compiled chunk kernels and its numpy path alternately
  in the same run (``kernels`` names the path of the headline figures, ``throughput_06b_numpy`` the other;
  both must code deltas of the same size).

Timings are on this machine's CPU, with ``torch`` at one thread; ``full_copy_s`` (copying the full published
directory) is the baseline the apply time is compared with. Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TIMED = ("encode", "apply", "copy", "encode_cpu", "apply_cpu")
MAX_SHARE = 0.5  # the design's delta_max_share: above it the trainer publishes a full checkpoint
POLICY_FILES = (  # prime_node/roles/trainer_service.py's POLICY_FILES (not imported: it pulls in the node)
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def _publish(base: Path, out: Path, weights: dict[str, Any], dtype: str) -> Path:
    """What the trainer service shares for one step: the base's policy files and the weights in ``dtype``."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    for name in POLICY_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
    cast = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    published = {
        name: tensor.to(cast).contiguous() if tensor.is_floating_point() else tensor
        for name, tensor in weights.items()
    }
    save_file(published, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _with_answers(batch: Any, task: Any, tokenizer: Any, group_size: int) -> Any:
    """The batch with the first completion of every group replaced by the right answer."""
    from protocol.rollouts import pack_tokens

    samples = list(batch.samples)
    for index in range(0, len(samples), group_size):
        sample = samples[index]
        answer = [*tokenizer.encode(task.answer(sample.task_id), add_special_tokens=False)]
        answer.append(tokenizer.eos_token_id)
        samples[index] = dataclasses.replace(
            sample, completion=pack_tokens(answer), logprobs=b"\x00\x00\x80\xbf" * len(answer)
        )
    return dataclasses.replace(batch, samples=tuple(samples))


def _train(
    model_dir: Path, config: Any, steps: int, dtypes: tuple[str, ...], inject: bool, work: Path
) -> tuple[dict[str, list[Path]], list[int], float]:
    """Run ``steps`` GRPO steps from ``model_dir``; returns the published directories per dtype (steps
    0..steps), the groups kept per step and the mean seconds per step (rollouts and training)."""
    from prime_node.ml.distributed import DistInfo
    from prime_node.ml.engine import TorchEngine
    from prime_node.ml.fsdp import full_weights
    from prime_node.ml.model import load_model
    from prime_node.ml.prepared import prepare
    from prime_node.ml.rollout_batch import LOCAL_WORKER, make_batch, with_tied_head
    from prime_node.ml.tokenizer import load_tokenizer
    from prime_node.ml.trainer import GRPOTrainer
    from prime_node.tasks.factory import build_task

    tokenizer = load_tokenizer(model_dir)
    task = build_task(config.task)
    trainer = GRPOTrainer(
        config, load_model(model_dir), tokenizer, checkpoint_root=work / "history", dist=DistInfo()
    )
    engine = TorchEngine(
        load_model(model_dir), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    published: dict[str, list[Path]] = {dtype: [] for dtype in dtypes}
    kept: list[int] = []

    def publish(step: int) -> None:
        weights = full_weights(trainer.model)  # the policy the trainer is at (``step``)
        for dtype in dtypes:
            published[dtype].append(_publish(model_dir, work / dtype / f"step_{step}", weights, dtype))

    publish(0)
    began = time.perf_counter()
    for step in range(steps):
        engine.load_weights(with_tied_head(engine.model, full_weights(trainer.model)), step)
        batch = make_batch(
            engine, task, tokenizer, config, worker=LOCAL_WORKER, policy_step=step, batch_counter=step
        )
        if inject:
            batch = _with_answers(batch, task, tokenizer, config.group_size)
        prepared = prepare(batch, current_step=step, task=task, tokenizer=tokenizer, config=config)
        trainer.train_step(prepared)
        kept.append(prepared.groups_kept)
        publish(step + 1)
    return published, kept, (time.perf_counter() - began) / steps


def _deltas(versions: list[Path], work: Path) -> dict[str, Any]:
    """Encode and apply the delta of each version against the one before; check it byte-identical."""
    from prime_node.swarm.delta_codec import apply_delta, encode_delta

    work.mkdir(parents=True, exist_ok=True)
    ratios, changed, encode_s, apply_s, copy_s = [], [], [], [], []
    delta_bytes = full_bytes = values = 0
    for index, (base, target) in enumerate(itertools.pairwise(versions)):
        delta = work / f"delta_{index}"
        stats = encode_delta(base, target, delta)
        began = time.perf_counter()
        apply_delta(base, delta, work / f"out_{index}", max_output_bytes=stats.full_bytes)
        apply_s.append(time.perf_counter() - began)
        for path in sorted(target.iterdir()):
            if (work / f"out_{index}" / path.name).read_bytes() != path.read_bytes():
                raise SystemExit(f"delta {index}: {path.name} was not reconstructed byte-identical")
        began = time.perf_counter()
        shutil.copytree(target, work / f"copy_{index}")
        copy_s.append(time.perf_counter() - began)
        shutil.rmtree(work / f"out_{index}")
        shutil.rmtree(work / f"copy_{index}")
        ratios.append(stats.delta_bytes / stats.full_bytes)
        changed.append(stats.changed_values / stats.total_values)
        encode_s.append(stats.seconds)
        delta_bytes, full_bytes, values = stats.delta_bytes, stats.full_bytes, stats.total_values
    return {
        "ratio_mean": sum(ratios) / len(ratios),
        "ratio_max": max(ratios),
        "ratio_per_step": [round(r, 5) for r in ratios],
        "changed_fraction": sum(changed) / len(changed),
        "encode_s_per_step": sum(encode_s) / len(encode_s),
        "reconstruct_s_per_step": sum(apply_s) / len(apply_s),
        "full_copy_s": sum(copy_s) / len(copy_s),
        "last_delta_bytes": delta_bytes,
        "full_bytes": full_bytes,
        "values": values,
    }


def _use_kernels(path: str) -> str:
    """Select the codec's chunk path for this process (``delta_select``): "numba" or "numpy"; returns
    the one in use ("numpy" where numba is missing)."""
    from prime_node.swarm import delta_select

    os.environ[delta_select.ENV] = path
    delta_select.kernels.cache_clear()
    return "numpy" if delta_select.kernels() is None else "numba"


def _throughput(
    work: Path, seed: int, lr: float, steps: int, repeats: int, codec: str, paths: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """Encode and apply speed at the 0.6b shape in bf16 (see the module doc), against a copy, for each
    of the codec's chunk ``paths``, alternating within each repeat (a same-run ratio on a shared
    machine)."""
    import torch
    from safetensors.torch import load_file, save_file

    from prime_node.ml.architectures import write_model_dir

    module = importlib.import_module(codec)
    encode_delta, apply_delta = module.encode_delta, module.apply_delta

    model = write_model_dir("qwen3", "0.6b", seed, work / "model", vocab_size=4096, dtype="bfloat16")
    generator = torch.Generator().manual_seed(seed)
    masters = load_file(str(model / "model.safetensors"))
    for name, tensor in masters.items():
        jitter = (torch.rand(tensor.shape, generator=generator) * 2 - 1) * 2**-9
        masters[name] = tensor.float() * (1 + jitter)
    versions = []
    for step in range(steps + 1):
        out = work / f"step_{step}"
        shutil.copytree(model, out, ignore=shutil.ignore_patterns("model.safetensors"))
        save_file(
            {name: master.to(torch.bfloat16) for name, master in masters.items()},
            str(out / "model.safetensors"),
            metadata={"format": "pt"},
        )
        versions.append(out)
        for master in masters.values():
            master.add_((torch.rand(master.shape, generator=generator) * 2 - 1) * lr)
    del masters
    shutil.rmtree(model)
    results: dict[str, dict[str, Any]] = {}
    runs = {path: [{name: [] for name in TIMED} for _ in versions[1:]] for path in paths}
    stats_of: dict[tuple[str, int], Any] = {}
    used: dict[str, str] = {}
    for path in paths:  # untimed: numba compiles (or loads its cache) on first use
        if _use_kernels(path) != "numba":
            continue
        _time_once(encode_delta, apply_delta, versions[0], versions[1], work / "warm", runs[path][0])
        runs[path][0] = {name: [] for name in TIMED}
    for _ in range(repeats):  # the machine is shared: each measurement repeated, the median kept
        for path in paths:
            used[path] = _use_kernels(path)
            for index, (base, target) in enumerate(itertools.pairwise(versions)):
                stats_of[path, index] = _time_once(
                    encode_delta, apply_delta, base, target, work / f"{path}_{index}", runs[path][index]
                )
    for path in paths:
        encode_s, apply_s, copy_s, encode_cpu, apply_cpu = (
            [statistics.median(run[name]) for run in runs[path]] for name in TIMED
        )
        stats = [stats_of[path, index] for index in range(len(versions) - 1)]
        ratios = [found.delta_bytes / found.full_bytes for found in stats]
        gb = stats[0].full_bytes / 1e9
        encode, apply, copy_mean = (statistics.median(x) for x in (encode_s, apply_s, copy_s))
        results[path] = {
            "kernels": used[path],
            "full_bytes": stats[0].full_bytes,
            "lr": lr,
            "deltas": len(ratios),
            "repeats": repeats,
            "ratio_mean": sum(ratios) / len(ratios),
            "ratio_per_delta": [round(r, 5) for r in ratios],
            "delta_bytes": [found.delta_bytes for found in stats],
            "changed_fraction": sum(f.changed_values / f.total_values for f in stats) / len(stats),
            "encode_s_per_gb": encode / gb,
            "apply_s_per_gb": apply / gb,
            "copy_s_per_gb": copy_mean / gb,
            "encode_gb_per_s": gb / encode,
            "apply_gb_per_s": gb / apply,
            "copy_gb_per_s": gb / copy_mean,
            "encode_vs_copy": encode / copy_mean,
            "apply_vs_copy": apply / copy_mean,
            "encode_cpu_s_per_gb": statistics.median(encode_cpu) / gb,
            "apply_cpu_s_per_gb": statistics.median(apply_cpu) / gb,
            "encode_s": [round(x, 3) for x in encode_s],
            "apply_s": [round(x, 3) for x in apply_s],
            "copy_s": [round(x, 3) for x in copy_s],
            "cores": len(os.sched_getaffinity(0)),
            "load_average": os.getloadavg()[0],
        }
    return results


def _time_once(
    encode_delta: Any, apply_delta: Any, base: Path, target: Path, work: Path, runs: dict[str, list[float]]
) -> Any:
    """One encode, apply (checked byte-identical) and copy of ``target``, appended to ``runs``."""
    work.mkdir(parents=True, exist_ok=True)
    delta, out, copy = work / "delta", work / "out", work / "copy"
    cpu = time.process_time()
    stats = encode_delta(base, target, delta)
    runs["encode"].append(stats.seconds)
    runs["encode_cpu"].append(time.process_time() - cpu)
    began, cpu = time.perf_counter(), time.process_time()
    apply_delta(base, delta, out, max_output_bytes=stats.full_bytes)
    runs["apply"].append(time.perf_counter() - began)
    runs["apply_cpu"].append(time.process_time() - cpu)
    began = time.perf_counter()
    shutil.copytree(target, copy)
    runs["copy"].append(time.perf_counter() - began)
    for path in sorted(target.iterdir()):
        if (out / path.name).read_bytes() != path.read_bytes():
            raise SystemExit(f"0.6b delta of {target.name}: {path.name} was not reconstructed byte-identical")
    shutil.rmtree(out)
    shutil.rmtree(copy)
    delta.unlink()
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="consecutive GRPO steps (deltas) per model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate of the small model")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--skip-small", action="store_true", help="skip the trained small-model run")
    parser.add_argument("--skip-throughput", action="store_true", help="skip the 0.6b encode/apply speed")
    parser.add_argument("--throughput-deltas", type=int, default=2, help="0.6b deltas timed")
    parser.add_argument("--repeats", type=int, default=3, help="times each 0.6b measurement runs (median)")
    parser.add_argument(
        "--kernels",
        choices=("both", "numba", "numpy"),
        default="both",
        help="the codec's chunk path timed at 0.6b; both: alternately in one run (numba's figures first)",
    )
    parser.add_argument(
        "--codec",
        default="prime_node.swarm.delta_codec",
        help="module with encode_delta/apply_delta timed at 0.6b (a saved older codec, to compare)",
    )
    args = parser.parse_args()
    if args.lr > 1e-5:
        parser.error("--lr must be at most 1e-5 (the RL fine-tuning regime the bf16 goal is about)")

    import torch

    from prime_node.assets import copy_demo_model
    from prime_node.config import RunConfig
    from prime_node.ml.architectures import write_model_dir

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    result: dict[str, Any] = {"steps": args.steps, "seed": args.seed, "torch_threads": 1}
    with tempfile.TemporaryDirectory(prefix="delta-codec-bench-") as name:
        work = Path(name)
        common = {
            "run_id": "bench",
            "max_new_tokens": 5,
            "async_level": 4,
            "objective": "behaviour",
            "lr_schedule": "constant",
            "seed": args.seed,
            "threads": 1,
            "task": {"kind": "arithmetic", "digits": 2, "reverse_answer": True},
            "output_dir": work / "run",
        }
        if not args.skip_demo:
            demo = work / "demo_model"
            copy_demo_model(demo)
            config = RunConfig(
                **common, group_size=8, prompts_per_step=16, temperature=0.7, learning_rate=5e-4
            )
            published, kept, step_s = _train(demo, config, args.steps, ("float32",), False, work / "demo")
            found = _deltas(published["float32"], work / "demo")
            result |= {
                "delta_bytes_ratio_demo": found["ratio_mean"],
                "demo_full_fallback": found["ratio_max"] > MAX_SHARE,
                "demo": {**found, "lr": 5e-4, "groups_kept_per_step": kept, "train_s_per_step": step_s},
            }
        if not args.skip_throughput:
            paths = ("numba", "numpy") if args.kernels == "both" else (args.kernels,)
            timed = _throughput(
                work / "throughput",
                args.seed,
                args.lr,
                args.throughput_deltas,
                args.repeats,
                args.codec,
                paths,
            )
            shutil.rmtree(work / "throughput")
            found = timed[paths[0]]
            if len(paths) == 2:
                other = timed[paths[1]]
                if other["delta_bytes"] != found["delta_bytes"]:
                    raise SystemExit("the two chunk paths coded deltas of different sizes")
                result |= {
                    "throughput_06b_numpy": other,
                    "kernels_speedup_encode": other["encode_s_per_gb"] / found["encode_s_per_gb"],
                    "kernels_speedup_apply": other["apply_s_per_gb"] / found["apply_s_per_gb"],
                }
            result |= {
                "kernels": found["kernels"],
                "encode_gb_per_s_06b": found["encode_gb_per_s"],
                "apply_gb_per_s_06b": found["apply_gb_per_s"],
                "encode_vs_copy_06b": found["encode_vs_copy"],
                "apply_vs_copy_06b": found["apply_vs_copy"],
                "encode_s_per_gb_06b": found["encode_s_per_gb"],
                "apply_s_per_gb_06b": found["apply_s_per_gb"],
                "delta_ratio_06b": found["ratio_mean"],
                "codec": args.codec,
                "throughput_06b": found,
            }
        if args.skip_small:
            print(json.dumps(result))
            return
        small = write_model_dir("qwen3", "small", args.seed, work / "small_model")
        config = RunConfig(**common, group_size=8, prompts_per_step=8, temperature=1.0, learning_rate=args.lr)
        published, kept, step_s = _train(
            small, config, args.steps, ("bfloat16", "float32"), True, work / "small"
        )
        bf16 = _deltas(published["bfloat16"], work / "small" / "bf16-deltas")
        fp32 = _deltas(published["float32"], work / "small" / "fp32-deltas")
        result |= {
            "delta_bytes_ratio_bf16": bf16["ratio_mean"],
            "changed_fraction": bf16["changed_fraction"],
            "encode_s_per_step": bf16["encode_s_per_step"],
            "reconstruct_s_per_step": bf16["reconstruct_s_per_step"],
            "model_bytes_bf16": bf16["full_bytes"],
            "model_bytes_fp32": fp32["full_bytes"],
            "model_values_small": bf16["values"],
            "small": {
                "lr": args.lr,
                "groups_kept_per_step": kept,
                "train_s_per_step": step_s,
                "bf16": bf16,
                "fp32": fp32,
            },
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
