"""``prime-node init-model`` (create a model directory: the demo's tiny character model or a named
architecture and size) and ``prime-node filter-tasks``.

``--size`` help lists the sizes by hand (importing prime_node.ml would slow every ``--help``): a test
checks it names every shape in ``prime_node.ml.architectures.SHAPES``.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Annotated

import typer

from prime_node.assets import copy_demo_model
from prime_node.cli.options import JsonOption
from prime_node.errors import NodeError
from prime_node.tasks.arithmetic import ArithmeticTask


def register(app: typer.Typer) -> None:
    app.command("init-model")(init_model)
    app.command("filter-tasks")(filter_tasks)


def init_model(
    out_dir: Annotated[
        Path, typer.Argument(help="Directory to write (config, tokenizer, model.safetensors).")
    ],
    tiny: Annotated[
        bool, typer.Option("--tiny", help="Create the demo's tiny character-level Qwen2-style model.")
    ] = False,
    arch: Annotated[
        str | None,
        typer.Option(
            "--arch",
            help="Create a model of this architecture (qwen3) with a byte-level BPE tokenizer and a chat "
            "template, randomly initialised.",
        ),
    ] = None,
    size: Annotated[
        str,
        typer.Option(
            "--size",
            help="With --arch: tiny (~0.26M parameters), small (~16M) or 0.6b (Qwen3-0.6B's shape: 596M "
            "at its 151,936-token vocabulary, 445M at --vocab 4096; written in bf16).",
        ),
    ] = "tiny",
    vocab: Annotated[
        int | None,
        typer.Option(
            "--vocab",
            help="With --arch: vocabulary size, 259 to 151936 (default: the size's). The BPE is trained on "
            "the packaged corpus up to it (5,679 tokens at most) and filled with reserved ids, so the "
            "model's embedding and the tokenizer have exactly this many ids.",
        ),
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            help="With --arch: dtype of the written weights, bf16 or fp32; auto: the size's (bf16 for "
            "0.6b, as Qwen3 ships; fp32 for tiny and small).",
        ),
    ] = "auto",
    task: Annotated[
        str, typer.Option("--task", help="Task of the supervised warm-up: arithmetic.")
    ] = "arithmetic",
    digits: Annotated[int, typer.Option("--digits", help="Arithmetic: digits per operand.")] = 2,
    seed: Annotated[int, typer.Option("--seed", help="Seed of initialisation and warm-up.")] = 0,
    no_warmup: Annotated[
        bool, typer.Option("--no-warmup", help="Skip the supervised warm-up (random weights).")
    ] = False,
    from_package: Annotated[
        bool,
        typer.Option(
            "--from-package",
            help="Copy the demo's packaged, already warmed-up arithmetic model (the same on every machine).",
        ),
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Write into a non-empty directory.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Write a causal LM as a Hugging Face model directory: with --tiny the demo's character model, warmed
    up on the task unless told not to; with --arch a named architecture and size."""
    if tiny == (arch is not None):
        raise NodeError(
            "pass either --tiny or --arch qwen3 --size tiny|small|0.6b; or point the run config at any HF "
            "model directory",
            reason="bad_flag",
        )
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise NodeError(f"{out_dir} is not empty (use --force to write into it)", reason="exists")
    if arch is not None:
        if from_package:
            raise NodeError("--from-package is the demo's --tiny model, not an --arch", reason="bad_flag")
        _init_named_model(arch, size, seed, out_dir, as_json, vocab=vocab, dtype=dtype)
        return
    if vocab is not None or dtype != "auto":
        raise NodeError(
            "--vocab and --dtype size an --arch model; the --tiny model has its fixed character vocabulary",
            reason="bad_flag",
        )
    if task != "arithmetic" and not no_warmup:
        raise NodeError(
            f"no supervised warm-up for task {task!r}: only arithmetic has one (use --no-warmup)",
            reason="bad_flag",
        )
    if from_package:
        if no_warmup or task != "arithmetic" or digits != 2:
            raise NodeError(
                "--from-package is the 2-digit arithmetic model, warmed up: no --task, --digits, --no-warmup",
                reason="bad_flag",
            )

        info = copy_demo_model(out_dir)
        keys = ("parameters", "warmup_steps", "warmup_probe_accuracy", "heldout_accuracy")
        _echo_summary({"model_dir": str(out_dir), **{k: info[k] for k in keys}}, as_json)
        return
    import torch

    from prime_node.ml.model import create_tiny_model, parameter_count, save_model_dir
    from prime_node.ml.warmup import supervised_warmup

    torch.set_num_threads(1)  # a 0.1M-parameter model is overhead-bound: more threads only contend
    model, tokenizer = create_tiny_model(seed)
    summary: dict[str, object] = {"model_dir": str(out_dir), "parameters": parameter_count(model)}
    if not no_warmup:
        result = supervised_warmup(model, tokenizer, ArithmeticTask(digits), seed=seed)
        summary.update(warmup_steps=result.steps, warmup_probe_accuracy=result.probe_accuracy)
    save_model_dir(model, tokenizer, out_dir)
    _echo_summary(summary, as_json)


DISK_SLACK_BYTES = 64 << 20
"""Beyond the weights: tokenizer, configs, and the filesystem's rounding."""


def _init_named_model(
    arch: str, size: str, seed: int, out_dir: Path, as_json: bool, *, vocab: int | None, dtype: str
) -> None:
    from prime_node.ml.architectures import checked_dtype, checked_vocab, create_model, model_shape
    from prime_node.ml.bpe_tokenizer import learned_size
    from prime_node.ml.model import parameter_count, save_model_dir

    shape = model_shape(arch, size)  # clear errors before anything is built
    vocab_size, weights_dtype = checked_vocab(shape, vocab), checked_dtype(shape, dtype)
    weight_bytes = shape.parameters(vocab_size) * (2 if weights_dtype == "bfloat16" else 4)
    _check_disk(out_dir, weight_bytes + DISK_SLACK_BYTES)
    started = time.monotonic()
    model, tokenizer = create_model(arch, size, seed, vocab_size=vocab_size, dtype=weights_dtype)
    save_model_dir(model, tokenizer, out_dir)
    summary = {
        "model_dir": str(out_dir),
        "arch": arch,
        "size": size,
        "parameters": parameter_count(model),
        "vocab_size": len(tokenizer),
        "learned_tokens": learned_size(tokenizer),
        "tied_head": bool(model.config.tie_word_embeddings),
        "dtype": weights_dtype,
        "bytes_written": sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file()),
        "seconds": round(time.monotonic() - started, 1),
    }
    _echo_summary(summary, as_json)


def _check_disk(out_dir: Path, needed: int) -> None:
    """NodeError ``disk_full`` before a minute of initialising, not an OSError half-way through writing."""
    existing = out_dir.resolve()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return  # cannot tell: let the write say
    if free < needed:
        raise NodeError(
            f"{out_dir}: {needed / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free on its disk; free space, "
            "write elsewhere, or pass --dtype bf16 / a smaller --vocab",
            reason="disk_full",
        )


def _echo_summary(summary: dict[str, object], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo("\n".join(f"{key:24} {value}" for key, value in summary.items()))


def filter_tasks(
    config: Annotated[Path, typer.Option("--config", help="Run config naming the task.", dir_okay=False)],
    model: Annotated[
        Path | None, typer.Option("--model", help="Model directory (default: model_dir).")
    ] = None,
    low: Annotated[float, typer.Option("--lo", help="Keep tasks with pass rate >= this.")] = 0.1,
    high: Annotated[float, typer.Option("--hi", help="Keep tasks with pass rate <= this.")] = 0.9,
    samples: Annotated[int, typer.Option("--samples", help="Completions sampled per task.")] = 8,
    limit: Annotated[
        int, typer.Option("--limit", help="Examine at most this many training tasks (0: all).")
    ] = 0,
    out: Annotated[
        Path, typer.Option("--out", help="JSONL to write: one kept task per line.", dir_okay=False)
    ] = Path("filtered.jsonl"),
) -> None:
    """Offline pass-rate filter: keep the training tasks whose pass rate under MODEL lies in [lo, hi]."""
    from prime_node.config import load_run_config
    from prime_node.ml.task_filter import filter_by_pass_rate

    run = load_run_config(config)
    model_dir = model or run.model_dir
    if model_dir is None:
        raise NodeError("no model: pass --model or set model_dir in the run config", reason="bad_config")
    if not 0.0 <= low <= high <= 1.0:
        raise NodeError("need 0 <= --lo <= --hi <= 1", reason="bad_flag")
    kept, seen = filter_by_pass_rate(
        run, model_dir, low=low, high=high, samples=samples, limit=limit, out=out
    )
    typer.echo(f"kept {kept} of {seen} tasks -> {out}")
