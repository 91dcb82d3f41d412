"""FSDP2 trainer throughput and memory per rank: 1 and 2 gloo ranks on the `small` Qwen3-shaped model.

For each world size the benchmark starts ``torchrun --standalone --nproc_per_node=N`` on this file's
``--worker`` mode. Every rank loads the model written by ``prime_node.ml.architectures.write_model_dir``
("qwen3", "small"), builds the FSDP2 ``GRPOTrainer`` (parameters, gradients and AdamW state sharded),
and trains on one fixed synthetic batch (random prompts and completions, random advantages and
behaviour log-probs: the speed and memory of a step do not depend on what the tokens say): one warm-up
step, then ``--steps`` timed steps. Throughput counts every token of every sequence in the batch (the
whole batch, all ranks together) per second of optimizer step.

Memory per rank is counted from the local shards after a step, when gradients and both AdamW moments
exist (``fsdp.local_state_bytes``: parameters + gradients + optimizer state); peak RSS per rank is
reported beside it (it also holds activations, the interpreter and torch itself).

Prints ONE JSON line: ``ranks`` (the most measured), ``tokens_per_s_by_ranks``, ``state_mib_by_ranks``,
``memory_per_rank_ratio`` (state per rank at the most ranks ÷ at 1 rank; goal ≤ 0.65),
``peak_rss_mib_by_ranks`` (one value per rank), and the settings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _batch(
    tokenizer_size: int, samples: int, prompt_tokens: int, completion_tokens: int, seed: int
) -> object:
    import torch

    from prime_node.ml.trainer import Prepared

    generator = torch.Generator().manual_seed(seed)
    length = prompt_tokens + completion_tokens
    sequences = torch.randint(10, tokenizer_size, (samples, length), generator=generator).tolist()
    behaviour = (-1.0 - torch.rand(samples, completion_tokens, generator=generator)).tolist()
    advantages = torch.randn(samples, generator=generator).tolist()
    return Prepared(0, sequences, [prompt_tokens] * samples, advantages, 0.5, samples // 4, 0, behaviour)


def worker(args: argparse.Namespace) -> None:
    import resource

    import torch

    from prime_node.config import RunConfig
    from prime_node.ml.distributed import init_from_env, shutdown
    from prime_node.ml.fsdp import local_state_bytes
    from prime_node.ml.model import load_model
    from prime_node.ml.tokenizer import load_tokenizer
    from prime_node.ml.trainer import GRPOTrainer, Prepared

    torch.set_num_threads(args.threads)
    dist = init_from_env()
    model_dir = Path(args.model_dir)
    tokenizer = load_tokenizer(model_dir)
    config = RunConfig.model_validate(
        {
            "output_dir": args.out,
            "micro_batch_samples": args.micro_batch,
            "max_new_tokens": args.completion_tokens,
            "train_dtype": args.train_dtype,
            "activation_checkpointing": args.activation_checkpointing,
        }
    )
    trainer = GRPOTrainer(
        config, load_model(model_dir), tokenizer, checkpoint_root=Path(args.out) / "ckpt", dist=dist
    )
    prepared = _batch(len(tokenizer), args.samples, args.prompt_tokens, args.completion_tokens, seed=1)
    assert isinstance(prepared, Prepared)
    trainer.train_step(prepared)  # warm-up: allocations, first collectives
    state_bytes = local_state_bytes(trainer.model, trainer.optimizer)
    dist_barrier = dist.barrier if dist.world_size > 1 else (lambda: None)
    dist_barrier()
    began = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step(prepared)
    dist_barrier()
    elapsed = time.perf_counter() - began
    result = {
        "rank": dist.rank,
        "world_size": dist.world_size,
        "step_s": elapsed / args.steps,
        "tokens_per_step": sum(len(s) for s in prepared.sequences),
        "state_bytes": state_bytes,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params": sum(p.numel() for p in trainer.model.parameters()),
    }
    (Path(args.out) / f"rank{dist.rank}.json").write_text(json.dumps(result))
    shutdown()


def _run(nproc: int, args: argparse.Namespace, model_dir: Path, out: Path) -> list[dict[str, float]]:
    out.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        __file__,
        "--worker",
        *("--model-dir", str(model_dir), "--out", str(out), "--steps", str(args.steps)),
        *("--samples", str(args.samples), "--prompt-tokens", str(args.prompt_tokens)),
        *("--completion-tokens", str(args.completion_tokens), "--micro-batch", str(args.micro_batch)),
        *("--threads", str(args.threads), "--train-dtype", args.train_dtype),
        *(("--activation-checkpointing",) if args.activation_checkpointing else ()),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"torchrun with {nproc} ranks failed:\n{done.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=str, default="1,2", help="comma-separated world sizes")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per world size")
    parser.add_argument("--samples", type=int, default=16, help="sequences per optimizer batch")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per forward/backward")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--train-dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from prime_node.ml.architectures import write_model_dir

    ranks = [int(r) for r in args.ranks.split(",")]
    began = time.perf_counter()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir("qwen3", "small", args.seed, Path(tmp) / "small")
        runs = {n: _run(n, args, model_dir, Path(tmp) / f"n{n}") for n in ranks}
    tokens_per_s = {
        str(n): round(r[0]["tokens_per_step"] / max(x["step_s"] for x in r), 1) for n, r in runs.items()
    }
    state_mib = {str(n): round(max(x["state_bytes"] for x in r) / 2**20, 2) for n, r in runs.items()}
    most = max(ranks)
    ratio = max(x["state_bytes"] for x in runs[most]) / max(x["state_bytes"] for x in runs[min(ranks)])
    print(
        json.dumps(
            {
                "benchmark": "trainer",
                "model": "qwen3-small",
                "params": runs[min(ranks)][0]["params"],
                "ranks": most,
                "tokens_per_s_by_ranks": tokens_per_s,
                "state_mib_by_ranks": state_mib,
                "memory_per_rank_ratio": round(ratio, 3),
                "memory_goal": 0.65,
                "peak_rss_mib_by_ranks": {
                    str(n): [round(x["peak_rss_mib"], 1) for x in r] for n, r in runs.items()
                },
                "step_s_by_ranks": {str(n): round(max(x["step_s"] for x in r), 3) for n, r in runs.items()},
                "batch": {
                    "samples": args.samples,
                    "tokens": runs[min(ranks)][0]["tokens_per_step"],
                    "micro_batch": args.micro_batch,
                },
                "threads_per_rank": args.threads,
                "train_dtype": args.train_dtype,
                "activation_checkpointing": args.activation_checkpointing,
                "cores": os.cpu_count(),
                "load_before": round(load_before, 2),
                "wall_s": round(time.perf_counter() - began, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
