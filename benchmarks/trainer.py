"""FSDP2 trainer memory and throughput per rank: 1 and 2 gloo ranks of the real training session.

For each world size the benchmark starts ``torchrun --standalone --nproc_per_node=N`` on this file's
``--worker`` mode. Every rank opens the ``TrainingSession`` that ``run-trainer`` opens (the model built
on the meta device and each rank reading its own rows of the weights, the FSDP2 ``GRPOTrainer``, the
sharded training state and the step-0 checkpoint), then trains on one fixed synthetic batch (random
prompts and completions, advantages and behaviour log-probs: the speed and memory of a step do not
depend on what the tokens say): one warm-up step, then ``--steps`` timed steps, each with everything a
session step does (the sharded AdamW state saved — every step with the default
``--checkpoint-every 1``, the worst case —, the policy's weights file written by every rank, the
checkpoint finished by rank 0's writer thread).

``checkpoint_share``: seconds of checkpoint work on the training loop's path (the policy's weights file,
capturing a training-state save and waiting for the previous one before the optimizer step; the
background writes excluded) ÷ seconds of step, over the timed steps of rank 0; ``open_s``: opening the
session (model load and step 0's files, whose saves run in the background).

Memory per rank: the peak RSS of the rank's process (``ru_maxrss``: everything, the interpreter and
torch included) divided by its share of the training state, 16 bytes per parameter (fp32 weights,
gradients and both AdamW moments) ÷ ranks: ``rss_per_rank_ratio`` (goal ≤ 1.3, issue 32). The local
shards (``fsdp.local_state_bytes``) and the RSS right after the session opened are reported beside it.
Throughput counts every token of the batch (all ranks together) per second of step.

``--size``: ``tiny`` (0.26M parameters), ``small`` (16M, untied head) or ``0.44b`` (Qwen3-0.6B's shape
with the 4,096-token BPE: hidden 1024, 28 layers, MLP 3072, 16/8 heads of 128, tied head; 444.7M
parameters, written in bf16 like the issue's model; needs ~14 GiB free for both world sizes).

Prints ONE JSON line: ``params``, ``rss_per_rank_ratio`` (worst rank of any world size),
``rss_per_rank_ratio_by_ranks`` and ``peak_rss_mib_by_ranks`` (one value per rank), ``checkpoint_share``
(worst world size) and ``checkpoint_share_by_ranks``, ``open_s_by_ranks``,
``open_rss_mib_by_ranks``, ``state_mib_by_ranks``, ``memory_per_rank_ratio`` (local shards at the most
ranks ÷ at 1 rank; goal ≤ 0.65), ``tokens_per_s_by_ranks``, ``step_s_by_ranks``, and the settings.
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

GOAL = 1.3
BYTES_PER_PARAM = 16  # fp32 weights + gradients + two AdamW moments


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def make_model(size: str, out: Path, seed: int, layers: int | None = None) -> None:
    """Write the model directory of ``size`` (own process: the parent stays small)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from prime_node.ml.architectures import ModelShape, model_config, write_model_dir
    from prime_node.ml.bpe_tokenizer import train_bpe_tokenizer
    from prime_node.ml.model import save_model_dir

    if size in ("tiny", "small"):
        write_model_dir("qwen3", size, seed, out)
        return
    shape = ModelShape(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=layers or 28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=True,
        max_positions=4096,
    )
    tokenizer = train_bpe_tokenizer(shape.vocab_size)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(model_config(shape, tokenizer)).bfloat16()
    save_model_dir(model, tokenizer, out)


def _batch(vocab: int, samples: int, prompt_tokens: int, completion_tokens: int, seed: int) -> object:
    import torch

    from prime_node.ml.prepared import Prepared

    generator = torch.Generator().manual_seed(seed)
    length = prompt_tokens + completion_tokens
    sequences = torch.randint(10, vocab, (samples, length), generator=generator).tolist()
    behaviour = (-1.0 - torch.rand(samples, completion_tokens, generator=generator)).tolist()
    advantages = torch.randn(samples, generator=generator).tolist()
    return Prepared(0, sequences, [prompt_tokens] * samples, advantages, 0.5, samples // 4, 0, behaviour)


def worker(args: argparse.Namespace) -> None:
    import resource

    import torch

    from prime_node.config import RunConfig
    from prime_node.ml.distributed import init_from_env, shutdown
    from prime_node.ml.fsdp import local_state_bytes
    from prime_node.ml.prepared import Prepared
    from prime_node.ml.session import TrainingSession

    torch.set_num_threads(args.threads)
    dist = init_from_env()
    model_dir = Path(args.model_dir)
    config = RunConfig.model_validate(
        {
            "model_dir": str(model_dir),
            "output_dir": args.out,
            "micro_batch_samples": args.micro_batch,
            "max_new_tokens": args.completion_tokens,
            "train_dtype": args.train_dtype,
            "activation_checkpointing": args.activation_checkpointing,
            "objective": args.objective,
            "publish_dtype": args.publish_dtype,
            "checkpoint_every": args.checkpoint_every
            if args.checkpoint_every == "auto"
            else int(args.checkpoint_every),
        }
    )
    opening = time.perf_counter()
    session = TrainingSession(config, base=model_dir, dist=dist)
    open_s = time.perf_counter() - opening
    open_rss = _rss_mib()
    prepared = _batch(
        len(session.tokenizer), args.samples, args.prompt_tokens, args.completion_tokens, seed=1
    )
    assert isinstance(prepared, Prepared)
    times: list[float] = []
    on_path = 0.0
    if dist.is_main:
        for _ in range(1 + args.steps):  # the first is the warm-up: allocations, first collectives
            began = time.perf_counter()
            before = session.times["state_s"] + session.times["policy_s"]
            session.train([prepared])
            times.append(time.perf_counter() - began)
            if len(times) > 1:
                on_path += session.times["state_s"] + session.times["policy_s"] - before
        session.close()
    else:
        session.follow()
        session.close()
    state_bytes = local_state_bytes(session.trainer.model, session.trainer.optimizer)
    params = sum(p.numel() for p in session.trainer.model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        "rank": dist.rank,
        "world_size": dist.world_size,
        "step_s": sum(times[1:]) / max(1, len(times) - 1),
        "tokens_per_step": sum(len(s) for s in prepared.sequences),
        "state_bytes": state_bytes,
        "peak_rss_bytes": peak,
        "open_rss_mib": open_rss,
        "open_s": open_s,
        "checkpoint_share": on_path / max(1e-9, sum(times[1:])),
        "params": params,
        "ratio": peak / (BYTES_PER_PARAM * params / dist.world_size),
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
        *("--objective", args.objective, "--publish-dtype", args.publish_dtype),
        *("--checkpoint-every", args.checkpoint_every),
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
    parser.add_argument("--make-model", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="small", choices=["tiny", "small", "0.44b"])
    parser.add_argument("--ranks", type=str, default="1,2", help="comma-separated world sizes")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per world size")
    parser.add_argument("--samples", type=int, default=8, help="sequences per optimizer batch")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=2, help="samples per forward/backward")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--train-dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--objective", default="behaviour", choices=["behaviour", "recompute"])
    parser.add_argument("--publish-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument(
        "--checkpoint-every", default="1", help='training state every N steps or "auto" (1: every step)'
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, help="decoder layers of the 0.44b shape (default 28)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.make_model:
        make_model(args.size, Path(args.make_model), args.seed, args.layers)
        return

    ranks = [int(r) for r in args.ranks.split(",")]
    began = time.perf_counter()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        model_dir = Path(tmp) / args.size
        subprocess.run(
            [
                sys.executable,
                __file__,
                *("--make-model", str(model_dir), "--size", args.size),
                *(("--layers", str(args.layers)) if args.layers else ()),
            ],
            cwd=REPO,
            check=True,
        )
        runs = {n: _run(n, args, model_dir, Path(tmp) / f"n{n}") for n in ranks}
    params = runs[min(ranks)][0]["params"]
    ratios = {str(n): [round(x["ratio"], 3) for x in r] for n, r in runs.items()}
    state = {n: max(x["state_bytes"] for x in r) for n, r in runs.items()}
    print(
        json.dumps(
            {
                "benchmark": "trainer",
                "model": f"qwen3-{args.size}" + (f"-{args.layers}-layers" if args.layers else ""),
                "params": params,
                "rss_per_rank_ratio": max(max(v) for v in ratios.values()),
                "rss_goal": GOAL,
                "rss_per_rank_ratio_by_ranks": ratios,
                "peak_rss_mib_by_ranks": {
                    str(n): [round(x["peak_rss_bytes"] / 2**20, 1) for x in r] for n, r in runs.items()
                },
                "share_mib_by_ranks": {str(n): round(BYTES_PER_PARAM * params / n / 2**20, 1) for n in runs},
                "open_rss_mib_by_ranks": {
                    str(n): [round(x["open_rss_mib"], 1) for x in r] for n, r in runs.items()
                },
                "state_mib_by_ranks": {str(n): round(b / 2**20, 1) for n, b in state.items()},
                "memory_per_rank_ratio": round(state[max(ranks)] / state[min(ranks)], 3),
                "memory_goal": 0.65,
                "tokens_per_s_by_ranks": {
                    str(n): round(r[0]["tokens_per_step"] / r[0]["step_s"], 1) for n, r in runs.items()
                },
                "step_s_by_ranks": {str(n): round(r[0]["step_s"], 2) for n, r in runs.items()},
                "checkpoint_share": max(round(r[0]["checkpoint_share"], 3) for r in runs.values()),
                "checkpoint_share_by_ranks": {
                    str(n): round(r[0]["checkpoint_share"], 3) for n, r in runs.items()
                },
                "open_s_by_ranks": {str(n): round(r[0]["open_s"], 1) for n, r in runs.items()},
                "checkpoint_every": args.checkpoint_every,
                "batch": {
                    "samples": args.samples,
                    "tokens": runs[min(ranks)][0]["tokens_per_step"],
                    "micro_batch": args.micro_batch,
                },
                "objective": args.objective,
                "publish_dtype": args.publish_dtype,
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
