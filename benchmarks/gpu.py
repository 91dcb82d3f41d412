"""The GPU device check: our engine against Hugging Face ``generate``, proof overhead, the GPU verification
pairs and the FSDP2 trainer on one GPU. Writes ONE JSON file (and prints it as one line).

Made to run on a lent GPU machine in one call (PyTorch and transformers there; the project's other
dependencies carried as wheels: scripts/gpu-check.sh) in well under 8 minutes, and with ``--dry-run``
here on the CPU: the same code at toy sizes, tested in CI (tests/test_gpu_check.py).

Sections (``--sections``, all by default):

- ``throughput``: decode tokens/s of ``TorchEngine.generate`` (the seeded Gumbel rule, KV cache) and of
  plain ``model.generate`` (multinomial sampling, the same number of new tokens) at batch 1/16/64, on the
  ``small`` model and the Qwen3-0.6B shape (its real 151,936-token vocabulary), both bf16, beside the
  memory-bandwidth bound: batch × measured copy bandwidth ÷ weight bytes tokens/s.
- ``proof``: seconds of generation with hidden states and TOPLOC proofs ÷ without (batch 16).
- ``calibration``: honest batches and the nine attacks of ``prime_node.verification.cheating`` for the
  pairs (cuda bf16 → cuda bf16), (cuda bf16 → cpu fp32) and (cpu fp32 → cuda bf16), made and checked by
  benchmarks/verification_dtypes.py's modes. The GPU inferer generates many batches per engine call
  (``--gen-batch``) with the default (SDPA) attention; validators prefill one batch at a time with eager
  attention, so batch composition, padding and attention kernels all differ between the two sides. The
  checks run with no bounds (``--bounds measure``) and every batch's distances come back: the bounds are
  chosen from them afterwards (docs/verification.md), and each pair's false rejects and detections are
  computed for the bounds chosen.
- ``trainer``: the FSDP2 ``GRPOTrainer`` on one GPU (a 1-rank NCCL group), 3 steps of the small model on
  a fixed batch in float32, losses beside the same steps on the CPU; the policy written as a checkpoint
  and read back.

Usage: python benchmarks/gpu.py --out FILE [--dry-run] [--honest-batches 1000] [--sections a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DTYPES_BENCH = ROOT / "benchmarks" / "verification_dtypes.py"
SECTIONS = ("throughput", "proof", "calibration", "trainer")


class Plan:
    """Sizes of one run: the real ones on a GPU, toy ones for ``--dry-run`` on the CPU."""

    def __init__(self, dry_run: bool, honest_batches: int, cpu_workers: int) -> None:
        self.dry_run = dry_run
        self.device = "cpu" if dry_run else "cuda"
        self.batches = (1, 2) if dry_run else (1, 16, 64)
        self.new_tokens = 8 if dry_run else 128
        self.rounds = 1 if dry_run else 3
        self.prompt_tokens = 8 if dry_run else 32
        self.honest_batches = honest_batches
        self.attempts = 1 if dry_run else 5
        self.gen_batch = 4 if dry_run else 256
        self.cpu_workers = cpu_workers
        self.trainer_steps = 3


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(device: str, work: Callable[[], Any]) -> tuple[float, Any]:
    _sync(device)
    began = time.perf_counter()
    result = work()
    _sync(device)
    return time.perf_counter() - began, result


def machine(plan: Plan) -> dict[str, Any]:
    """What ran it, and the device's copy bandwidth (bytes read + written per second)."""
    import torch
    import transformers

    facts: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__}
    size = (64 if plan.dry_run else 2048) << 20
    source = torch.empty(size, dtype=torch.uint8, device=plan.device)
    target = torch.empty_like(source)
    target.copy_(source)

    def copies() -> None:
        for _ in range(5):
            target.copy_(source)

    took, _ = _timed(plan.device, copies)
    facts["copy_bandwidth_gb_s"] = round(2 * 5 * size / took / 1e9, 1)
    if plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=props.name, vram_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return facts


def _models(plan: Plan) -> dict[str, tuple[Any, Any]]:
    """name → (bf16 model on the device, tokenizer): ``small`` and the Qwen3-0.6B shape (toy in a dry run)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from prime_node.ml.architectures import create_model, model_config, model_shape

    small, tokenizer = create_model("qwen3", "tiny" if plan.dry_run else "small", 0)
    real_06b = model_shape("qwen3", "0.6b")
    toy = model_shape("qwen3", "tiny")
    shape = toy if plan.dry_run else real_06b
    config = model_config(shape, tokenizer)
    config.vocab_size = 8_192 if plan.dry_run else real_06b.vocab_size
    torch.manual_seed(0)
    with torch.device(plan.device):
        big = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    name = "0.6b (toy)" if plan.dry_run else "0.6b"
    return {"small": (small.to(plan.device, torch.bfloat16).eval(), tokenizer), name: (big, tokenizer)}


def throughput(plan: Plan, models: dict[str, tuple[Any, Any]], bandwidth: float) -> list[dict[str, Any]]:
    from prime_node.ml.engines import setup_engine

    rows = []
    for name, (model, tokenizer) in models.items():
        engine = setup_engine(model, tokenizer, dtype="bfloat16")
        for batch in plan.batches:
            rows.append({"model": name, **_decode_speed(plan, engine, tokenizer, batch, bandwidth)})
    return rows


def _decode_speed(plan: Plan, engine: Any, tokenizer: Any, batch: int, bandwidth: float) -> dict[str, Any]:
    """Tokens/s of our engine and of ``model.generate`` on the same random prompts, and the bound."""
    import torch

    from prime_node.ml.engine import SamplingParams

    model = engine.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(
        10, len(tokenizer), (batch, plan.prompt_tokens), generator=torch.Generator().manual_seed(1)
    )
    prompts, seeds = ids.tolist(), list(range(batch))
    params = SamplingParams(plan.new_tokens, 1.0)
    inputs = ids.to(plan.device)
    mask = torch.ones_like(inputs)

    def hf(n: int) -> Any:
        return model.generate(
            input_ids=inputs,
            attention_mask=mask,
            do_sample=True,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )

    # The two alternate, best of ``plan.rounds`` each: a GPU idling between small kernels clocks down, so
    # whichever ran first or after a pause would otherwise pay for it.
    engine.generate(prompts, seeds, SamplingParams(4, 1.0))  # warm-up: kernels, allocator
    hf(4)
    ours, hf_rate = 0.0, 0.0
    for _ in range(plan.rounds):
        ours_s, done = _timed(plan.device, lambda: engine.generate(prompts, seeds, params))
        ours = max(ours, sum(len(c.tokens) for c in done) / ours_s)
        hf_s, out = _timed(plan.device, lambda: hf(plan.new_tokens))
        hf_rate = max(hf_rate, (out.shape[1] - plan.prompt_tokens) * batch / hf_s)
    bound = batch * bandwidth * 1e9 / weight_bytes  # a decode step reads every weight once
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "batch": batch,
        "new_tokens": plan.new_tokens,
        "rounds": plan.rounds,
        "ours_tok_s": round(ours, 1),
        "hf_generate_tok_s": round(hf_rate, 1),
        "ours_over_hf": round(ours / hf_rate, 3),
        "bandwidth_bound_tok_s": round(bound, 1),
        "ours_of_bound": round(ours / bound, 4),
    }


def proof_overhead(plan: Plan, models: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    import torch

    from prime_node.ml.engine import SamplingParams
    from prime_node.ml.engines import setup_engine
    from prime_node.verification.proofs import build_proofs

    model, tokenizer = models["small"]
    engine = setup_engine(model, tokenizer, dtype="bfloat16")
    batch = plan.batches[-1] if plan.dry_run else 16
    ids = torch.randint(
        10, len(tokenizer), (batch, plan.prompt_tokens), generator=torch.Generator().manual_seed(2)
    )
    prompts, seeds = ids.tolist(), list(range(batch))
    plain = SamplingParams(plan.new_tokens, 1.0)
    proven = SamplingParams(plan.new_tokens, 1.0, return_hidden=True)
    engine.generate(prompts, seeds, proven)
    plain_s = min(_timed(plan.device, lambda: engine.generate(prompts, seeds, plain))[0] for _ in range(3))

    def with_proofs() -> list[bytes]:
        done = engine.generate(prompts, seeds, proven)
        return build_proofs([c.hidden for c in done])

    proof_s = min(_timed(plan.device, with_proofs)[0] for _ in range(3))
    return {
        "batch": batch,
        "new_tokens": plan.new_tokens,
        "generate_s": round(plain_s, 4),
        "generate_and_prove_s": round(proof_s, 4),
        "overhead": round(proof_s / plain_s - 1, 4),
    }


# -- calibration: verification_dtypes.py's modes, side by side ---------------------------------------------


def _child(mode: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    command = [sys.executable, str(DTYPES_BENCH), mode, *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, process.args))} failed:\n{err[-4000:]}")  # type: ignore[arg-type]
    line: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return line


def _env(device: str) -> dict[str, str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
    )
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def calibration(plan: Plan, work: Path) -> dict[str, Any]:
    """Records of a GPU bf16 inferer and CPU fp32 inferers, checked by GPU bf16 and CPU fp32 validators."""
    sys.path.insert(0, str(DTYPES_BENCH.parent))
    from verification_dtypes import prepare

    facts = prepare(work, "tiny" if plan.dry_run else "small")
    common = ["--work", str(work), "--threads", "1"]
    gpu_records = work / "cuda-bf16.bin"
    began = time.perf_counter()
    gpu_gen = _child(
        "generate",
        [
            *common,
            "--records",
            str(gpu_records),
            "--dtype",
            "bfloat16",
            "--device",
            plan.device,
            "--honest-batches",
            str(plan.honest_batches),
            "--attempts",
            str(plan.attempts),
            "--gen-batch",
            str(plan.gen_batch),
        ],
        _env(plan.device),
    )
    # The CPU inferers: the honest batches split over the cores, the attacks in the first.
    shares = [
        plan.honest_batches // plan.cpu_workers + (k < plan.honest_batches % plan.cpu_workers)
        for k in range(plan.cpu_workers)
    ]
    cpu_records = [work / f"cpu-f32-{k}.bin" for k in range(plan.cpu_workers)]
    cpu_gen = [
        _child(
            "generate",
            [
                *common,
                "--records",
                str(cpu_records[k]),
                "--dtype",
                "float32",
                "--honest-batches",
                str(shares[k]),
                "--first-counter",
                str(sum(shares[:k])),
                "--attempts",
                str(plan.attempts if k == 0 else 0),
            ],
            _env("cpu"),
        )
        for k in range(plan.cpu_workers)
    ]
    generated = {"cuda_bf16": _result(gpu_gen)}
    validate = ["--bounds", "measure", "--raw"]
    gpu_by_gpu = _child(
        "validate",
        [
            *common,
            *validate,
            "--records",
            str(gpu_records),
            "--dtype",
            "bfloat16",
            "--device",
            plan.device,
            "--attn",
            "eager",
            "--inferer-dtype",
            "bfloat16",
        ],
        _env(plan.device),
    )
    gpu_by_cpu = [
        _child(
            "validate",
            [
                *common,
                *validate,
                "--records",
                str(gpu_records),
                "--dtype",
                "float32",
                "--inferer-dtype",
                "bfloat16",
                "--shard",
                f"{k}/{plan.cpu_workers}",
            ],
            _env("cpu"),
        )
        for k in range(plan.cpu_workers)
    ]
    cpu_lines = [_result(p) for p in cpu_gen]
    generated["cpu_f32"] = {
        "honest_batches": sum(line["honest_batches"] for line in cpu_lines),
        "s_per_honest_batch_per_core": max(line["s_per_honest_batch"] for line in cpu_lines),
    }
    cpu_by_gpu = _child(
        "validate",
        [
            *common,
            *validate,
            "--records",
            ",".join(map(str, cpu_records)),
            "--dtype",
            "bfloat16",
            "--device",
            plan.device,
            "--attn",
            "eager",
            "--inferer-dtype",
            "float32",
        ],
        _env(plan.device),
    )
    pairs = {
        "cuda_bf16->cuda_bf16": _pair([_result(gpu_by_gpu)]),
        "cuda_bf16->cpu_f32": _pair([_result(p) for p in gpu_by_cpu]),
        "cpu_f32->cuda_bf16": _pair([_result(cpu_by_gpu)]),
    }
    return {
        **facts,
        "generated": generated,
        "pairs": pairs,
        "wall_s": round(time.perf_counter() - began, 1),
    }


def _pair(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """One pair's shards merged: every honest batch's and attack attempt's distances, and what the checks
    that need no bound (signature, replay, staleness, schedule) said of each attack."""
    attacks: dict[str, list[dict[str, float]]] = {}
    reasons: dict[str, set[str]] = {}
    for line in lines:
        for attack, found in line["raw_attacks"].items():
            attacks.setdefault(attack, []).extend(found)
        for attack, seen in line["reasons_by_attack"].items():
            reasons.setdefault(attack, set()).update(seen)
    return {
        "honest_batches": sum(line["honest_batches"] for line in lines),
        "honest_rejected_without_bounds": {
            k: v for line in lines for k, v in line["honest_reject_reasons"].items()
        },
        "honest": [row for line in lines for row in line["raw_honest"]],
        "attacks": attacks,
        "reasons_by_attack": {a: sorted(r) for a, r in reasons.items()},
        "validate_wall_s": max(line["wall_s"] for line in lines),
    }


# -- the trainer -------------------------------------------------------------------------------------------


def trainer_worker(args: argparse.Namespace) -> None:
    """One process: ``--steps`` GRPO steps of the model in ``--model-dir`` on ``--device``; one JSON line."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from trainer import _batch

    from prime_node.config import RunConfig
    from prime_node.ml.checkpoint import read_weights, write_checkpoint
    from prime_node.ml.distributed import DistInfo
    from prime_node.ml.fsdp import full_weights
    from prime_node.ml.model import load_model
    from prime_node.ml.tokenizer import load_tokenizer
    from prime_node.ml.trainer import GRPOTrainer

    torch.manual_seed(0)
    model_dir, out = Path(args.model_dir), Path(args.out_dir)
    tokenizer = load_tokenizer(model_dir)
    config = RunConfig.model_validate(
        {
            "output_dir": str(out),
            "micro_batch_samples": 4,
            "max_new_tokens": 32,
            "train_dtype": args.train_dtype,
        }
    )
    trainer = GRPOTrainer(
        config,
        load_model(model_dir, device=args.device),
        tokenizer,
        checkpoint_root=out / "ckpt",
        dist=DistInfo(device=args.device),
    )
    prepared = _batch(len(tokenizer), 16, 32, 32, seed=1)
    losses, step_s = [], []
    for _ in range(args.steps):
        took, metrics = _timed(args.device, lambda: trainer.train_step(prepared))  # type: ignore[arg-type]
        losses.append(float(metrics.loss))
        step_s.append(round(took, 4))
    weights = {k: v.detach().to("cpu").clone() for k, v in full_weights(trainer.model).items()}
    written = write_checkpoint(out / "published", args.steps, weights, None, model_dir, {})
    back = read_weights(written.path)
    same = all(torch.equal(back[k], weights[k]) for k in back) and set(back) <= set(weights)
    print(
        json.dumps(
            {
                "device": args.device,
                "train_dtype": args.train_dtype,
                "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else "none",
                "losses": losses,
                "step_s": step_s,
                "checkpoint_tensors": len(back),
                "checkpoint_read_back_equal": same,
            }
        )
    )


def trainer_check(plan: Plan, work: Path) -> dict[str, Any]:
    from prime_node.ml.architectures import write_model_dir

    model_dir = write_model_dir("qwen3", "tiny" if plan.dry_run else "small", 0, work / "trainer-model")
    runs: dict[str, dict[str, Any]] = {}
    for name, device, dtype in (
        ("device_float32", plan.device, "float32"),
        ("device_auto", plan.device, "auto"),
        ("cpu_float32", "cpu", "float32"),
    ):
        if plan.dry_run and name != "device_float32":  # on the CPU the other two repeat it exactly
            continue
        command = [
            sys.executable,
            __file__,
            "--trainer-worker",
            "--device",
            device,
            "--train-dtype",
            dtype,
            "--model-dir",
            str(model_dir),
            "--out-dir",
            str(work / name),
            "--steps",
            str(plan.trainer_steps),
        ]
        env = dict(_env(device), OMP_NUM_THREADS="4")
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"trainer on {device} failed:\n{done.stderr[-4000:]}")
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    reference = runs["cpu_float32" if "cpu_float32" in runs else "device_float32"]["losses"]
    for run in runs.values():
        run["largest_loss_difference_to_cpu"] = max(
            abs(a - b) for a, b in zip(run["losses"], reference, strict=True)
        )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None, help="the JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="the same code on the CPU, toy sizes")
    parser.add_argument("--honest-batches", type=int, default=None, help="per pair (default 1000; dry run 6)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--cpu-workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--new-tokens", type=int, default=None, help="decode length (default 128; dry run 8)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating timed runs (default 3)")
    parser.add_argument("--trainer-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--train-dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer_worker:
        trainer_worker(args)
        return
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)} (known: {', '.join(SECTIONS)})")
    honest = args.honest_batches if args.honest_batches is not None else (6 if args.dry_run else 1000)
    plan = Plan(args.dry_run, honest, args.cpu_workers if not args.dry_run else min(2, args.cpu_workers))
    plan.new_tokens = args.new_tokens or plan.new_tokens
    plan.rounds = args.rounds or plan.rounds
    if not plan.dry_run:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --dry-run on a machine without a GPU")
    began = time.perf_counter()
    result: dict[str, Any] = {"benchmark": "gpu", "dry_run": plan.dry_run, "machine": machine(plan)}
    timings: dict[str, float] = {}
    result["section_s"] = timings

    def run(name: str, work: Callable[[], Any]) -> None:
        """One section; a failure is recorded and the next section still runs (one call, all the
        results it can give). The file is rewritten after each section, so a run cut short keeps them."""
        section_began = time.perf_counter()
        try:
            result[name] = work()
        except Exception as exc:  # a device run reports every section it can
            result.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[-3000:]
        timings[name] = round(time.perf_counter() - section_began, 1)
        result["wall_s"] = round(time.perf_counter() - began, 1)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result))

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        if {"throughput", "proof"} & set(sections):
            models = _models(plan)
            bandwidth = result["machine"]["copy_bandwidth_gb_s"]
            if "throughput" in sections:
                run("throughput", lambda: throughput(plan, models, bandwidth))
            if "proof" in sections:
                run("proof", lambda: proof_overhead(plan, models))
            del models
            _free(plan.device)
        if "calibration" in sections:
            run("calibration", lambda: calibration(plan, work / "calibration"))
        if "trainer" in sections:
            run("trainer", lambda: trainer_check(plan, work))
    print(json.dumps(result))
    if "errors" in result:
        raise SystemExit(f"sections failed: {', '.join(result['errors'])}")


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
