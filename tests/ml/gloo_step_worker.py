"""One GRPO optimizer step under torchrun, for tests/ml/test_local_run.py (not a test module itself).

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/ml/gloo_step_worker.py \\
        --model DIR --batch BATCH.json --out DIR [--sabotage drop-shard|no-allreduce|local-normalizer]

Every rank loads the same model and the same prepared batch (the test wrote it: in a real run rank 0
broadcasts it), and runs ``GRPOTrainer.train_step`` once: its strided shard, the loss normalised by the
whole batch's completion tokens, gradients summed over ranks with gloo (``DistInfo``). Each rank then
writes the summed gradient it holds (``grads_rank{R}.safetensors``) and the step's metrics.

``--sabotage`` breaks the data parallelism on purpose, to show the test's tolerance catches it:
``drop-shard`` (rank 1's gradient is lost), ``no-allreduce`` (each rank keeps its own shard's gradient),
``local-normalizer`` (each rank divides by its own shard's token count instead of the whole batch's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def _sabotage(kind: str, shard_scale: float) -> None:
    import torch.distributed as dist

    from prime_node.ml.distributed import DistInfo

    honest = DistInfo.all_reduce_gradients

    def broken(self: DistInfo, model: Any) -> None:
        if kind == "no-allreduce":
            return
        for param in model.parameters():
            if param.grad is None:
                continue
            if kind == "drop-shard" and self.rank == 1:
                param.grad.zero_()
            elif kind == "local-normalizer":
                param.grad.mul_(shard_scale)
        honest(self, model)

    DistInfo.all_reduce_gradients = broken  # type: ignore[method-assign]
    assert dist.is_available()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--batch", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sabotage", choices=["drop-shard", "no-allreduce", "local-normalizer"])
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import save_file

    from prime_node.config import RunConfig
    from prime_node.ml.distributed import init_from_env, shutdown
    from prime_node.ml.model import load_model
    from prime_node.ml.tokenizer import load_tokenizer
    from prime_node.ml.trainer import GRPOTrainer, Prepared

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    document = json.loads(args.batch.read_text())
    config = RunConfig.model_validate({**document["config"], "model_dir": str(args.model)})
    prepared = Prepared(**document["prepared"])
    dist = init_from_env()
    try:
        if args.sabotage is not None:
            mine = range(dist.rank, len(prepared.sequences), dist.world_size)
            shard_tokens = sum(len(prepared.sequences[i]) - prepared.prompt_lengths[i] for i in mine)
            _sabotage(args.sabotage, prepared.completion_tokens / shard_tokens)
        model = load_model(args.model)
        trainer = GRPOTrainer(
            config, model, load_tokenizer(args.model), checkpoint_root=args.out / "checkpoints", dist=dist
        )
        metrics = trainer.train_step(prepared)
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        args.out.mkdir(parents=True, exist_ok=True)
        save_file(grads, str(args.out / f"grads_rank{dist.rank}.safetensors"))
        if dist.is_main:
            summary = {"world_size": dist.world_size, "loss": metrics.loss, "grad_norm": metrics.grad_norm}
            (args.out / "metrics.json").write_text(json.dumps(summary))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
