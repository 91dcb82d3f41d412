"""The per-process entry point torchrun starts for ``run-trainer --nproc N --local`` (on one machine or,
with ``--nnodes``, on several): rank 0 runs the --local pipeline and drives the training session; ranks
> 0 only follow it (``LocalRun.run``). Rank 0 prints each step's and each evaluation's line as it happens,
as the one-process ``--local`` does (issue 36: they all came at the end)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from prime_node.errors import NodeError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prime_node.ml.dist_entry")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--model-dir")
    parser.add_argument("--output-dir")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--train-dtype")
    parser.add_argument("--gpu", default="auto", help="run-trainer --gpu: auto, none or indices (0,1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from prime_node.config import load_run_config
    from prime_node.hardware import parse_gpu_selection
    from prime_node.ml.distributed import check_same_run, init_from_env, shutdown, spans_machines
    from prime_node.ml.local_run import print_eval, print_step, run_local

    overrides = {
        key: value
        for key, value in (
            ("model_dir", args.model_dir),
            ("output_dir", args.output_dir),
            ("max_steps", args.max_steps),
            ("train_dtype", args.train_dtype),
        )
        if value is not None
    }
    try:
        config = load_run_config(args.config, overrides=overrides)
        dist = init_from_env(parse_gpu_selection(args.gpu))
        try:
            if spans_machines(dist):  # every node's ranks: rank 0's run, and its output directory
                check_same_run(config, dist)
            main_rank = dist.is_main  # the one that prints
            run_local(
                config,
                dist=dist,
                on_step=print_step if main_rank else None,
                on_eval=print_eval if main_rank else None,
            )
        except BaseException:
            shutdown(together=False)
            raise
        shutdown()
    except NodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from prime_node.ml.distributed import exit_process

    exit_process(main())
