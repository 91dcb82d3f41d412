"""GRPO optimizer steps under torchrun on FSDP2, for tests/ml/test_local_run.py (not a test module itself).

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/ml/gloo_step_worker.py \\
        --model DIR --batch BATCH.json --out DIR [--steps K]
        [--sabotage drop-shard|mean-reduce|local-normalizer]

One rank (N = 1) is also ``train(argv)`` in the calling process: torchrun with one process sets
WORLD_SIZE=1, for which ``init_from_env`` makes no process group and the trainer makes the in-process
1-rank one (``ensure_process_group``), so the rank runs the same code without the launcher and a second
interpreter loading torch.

Every rank loads the same model and the same prepared batch (the test wrote it: in a real run rank 0
broadcasts it) and runs ``GRPOTrainer.train_step`` on it ``--steps`` times: the model sharded with FSDP2
over the gloo ranks, each rank its strided shard of the samples, the loss normalised by the whole batch's
completion tokens, gradients reduce-scattered (summed) into each rank's shard. After the first step every
rank gathers the full gradient (``grads_rank{R}.safetensors``); rank 0 writes every step's loss and
gradient norm (``metrics.json``).

``--sabotage`` breaks the data parallelism on purpose, to show the test's tolerance catches it:
``drop-shard`` (rank 1 trains on none of its samples), ``mean-reduce`` (FSDP2's default mean over ranks
instead of the sum), ``local-normalizer`` (each rank divides by its own shard's token count instead of
the whole batch's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def _sabotage(kind: str, trainer: Any, shard_tokens: int) -> None:
    import prime_node.ml.trainer as trainer_module
    from prime_node.ml.grpo import grpo_loss as honest_loss

    if kind == "drop-shard" and trainer.dist.rank == 1:
        honest_chunks = trainer._my_chunks
        trainer._my_chunks = lambda prepared: [[] for _ in honest_chunks(prepared)]
    elif kind == "mean-reduce":
        from torch.distributed.fsdp import FSDPModule

        for module in trainer.model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(float(trainer.dist.world_size))
    elif kind == "local-normalizer":

        def local(*args: Any, normalizer: float, **kwargs: Any) -> Any:
            return honest_loss(*args, normalizer=float(shard_tokens), **kwargs)

        setattr(trainer_module, "grpo_loss", local)  # noqa: B010 (a deliberate patch)


def main(argv: list[str]) -> int:
    """One torchrun rank: ``train``, then leave the process group (all ranks together)."""
    from prime_node.ml.distributed import shutdown

    try:
        train(argv)
    except BaseException:
        shutdown(together=False)
        raise
    shutdown()
    return 0


def train(argv: list[str]) -> None:
    """The steps and the files they leave in ``--out``; the process group (if any) is left as it is."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--batch", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--sabotage", choices=["drop-shard", "mean-reduce", "local-normalizer"])
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import save_file

    from prime_node.config import RunConfig
    from prime_node.ml.distributed import init_from_env
    from prime_node.ml.model import load_model
    from prime_node.ml.prepared import Prepared
    from prime_node.ml.tokenizer import load_tokenizer
    from prime_node.ml.trainer import GRPOTrainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    document = json.loads(args.batch.read_text())
    config = RunConfig.model_validate({**document["config"], "model_dir": str(args.model)})
    prepared = Prepared(**document["prepared"])
    dist = init_from_env()
    model = load_model(args.model)
    trainer = GRPOTrainer(
        config, model, load_tokenizer(args.model), checkpoint_root=args.out / "checkpoints", dist=dist
    )
    if args.sabotage is not None:
        mine = range(dist.rank, len(prepared.sequences), dist.world_size)
        shard_tokens = sum(len(prepared.sequences[i]) - prepared.prompt_lengths[i] for i in mine)
        _sabotage(args.sabotage, trainer, shard_tokens)
    losses, norms = [], []
    for step in range(args.steps):
        metrics = trainer.train_step(prepared)
        losses.append(metrics.loss)
        norms.append(metrics.grad_norm)
        if step == 0:
            grads = {
                name: p.grad.full_tensor().detach().clone()
                for name, p in trainer.model.named_parameters()
                if p.grad is not None
            }
            args.out.mkdir(parents=True, exist_ok=True)
            save_file(grads, str(args.out / f"grads_rank{dist.rank}.safetensors"))
    if dist.is_main:
        summary = {"world_size": dist.world_size, "losses": losses, "grad_norms": norms}
        (args.out / "metrics.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    from prime_node.ml.distributed import exit_process

    exit_process(main(sys.argv[1:]))
