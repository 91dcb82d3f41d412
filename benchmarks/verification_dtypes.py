"""Honest false rejects and attack detection for every (inferer, validator) engine pair. JSON lines.

A validator never recomputes with the inferer's kernels. This benchmark generates honest batches and the
nine attacks of prime_node.verification.cheating once per *inferer* configuration (dtype, kernel set,
threads) into a temporary directory, then checks them with the real ``BatchValidator`` in a separate
process per *validator* configuration, so the kernel sets really differ (``ATEN_CPU_CAPABILITY`` is read
when torch loads: ``default`` selects PyTorch's scalar kernels, a stand-in for another CPU).

Per pair it prints one JSON line: ``false_reject_rate`` over ``honest_batches`` (goal ≤ 0.001 over ≥ 1,000),
``detected_by_attack`` (goal 1.0 each: rejected with a reason that identifies the attack), and the
honest and dishonest distributions the bounds were calibrated from (``honest``: worst chunk's exponent
mismatches and mantissa errors, worst log-prob error and replay margin; ``attacks_closest``: the attack
attempt nearest to passing). ``--bounds table`` checks with the calibrated table
(``prime_node.ml.engines.calibration``); ``--bounds measure`` with bounds that reject nothing on
recomputation (a calibration run: only the distributions count). Generation lines (``"run":
"generate"``) report the time per batch.

The model is the ``small`` Qwen3-shaped model (``prime_node.ml.architectures``), untrained: sampling at
the run's temperature (1.0) still makes honest completions random enough to exercise every check.

Usage: .venv/bin/python benchmarks/verification_dtypes.py [--honest-batches 1000] [--attempts 5]
       [--bounds table|measure] [--pairs all|fast] [--inferers all|float32|bfloat16]
       [--max-validate-batches N]

The ``generate`` and ``validate`` modes also take ``--device`` (``cuda``), ``--attn`` (the attention
implementation, e.g. ``eager`` or ``sdpa``), ``--gen-batch N`` (generate the requests of many batches in
engine calls of N samples, as a GPU inferer would), ``--shard K/N`` (validate every N-th honest record;
attacks in shard 0) and ``--raw`` (every batch's distances in the line): benchmarks/gpu.py drives them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CURRENT_STEP = 5
NOW_MS = 1_700_000_000_000
SAMPLES, GROUPS, MAX_NEW_TOKENS, TEMPERATURE = 2, 2, 40, 1.0
MODEL_SEED, OTHER_SEED = 0, 1
NO_BOUNDS = 1e9  # --bounds measure: nothing on recomputation is rejected, every distribution is seen


@dataclass(frozen=True)
class Side:
    """One process configuration: dtype, kernel set (``native`` or ``default``) and torch threads."""

    dtype: str
    kernels: str
    threads: int

    @property
    def name(self) -> str:
        return f"{self.dtype}/{self.kernels}/{self.threads}t"

    def env(self) -> dict[str, str]:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        env.pop("ATEN_CPU_CAPABILITY", None)
        if self.kernels != "native":
            env["ATEN_CPU_CAPABILITY"] = self.kernels
        return env

    def as_args(self) -> list[str]:
        return ["--dtype", self.dtype, "--kernels", self.kernels, "--threads", str(self.threads)]


F32, BF16 = "float32", "bfloat16"
# inferer → its validators: same kernels, other kernels (scalar), other thread count, other dtype.
PAIRS: dict[Side, list[Side]] = {
    Side(F32, "native", 1): [
        Side(F32, "native", 1),
        Side(F32, "default", 1),
        Side(F32, "native", 2),
        Side(BF16, "native", 1),
    ],
    Side(BF16, "native", 1): [
        Side(BF16, "native", 1),
        Side(BF16, "default", 2),
        Side(F32, "native", 1),
        Side(F32, "default", 2),
    ],
}
FAST_PAIRS: dict[Side, list[Side]] = {
    Side(F32, "native", 1): [Side(F32, "default", 2)],
    Side(BF16, "native", 1): [Side(F32, "default", 2)],
}


# -- the model -------------------------------------------------------------------------------------------


def small_model(seed: int, size: str = "small") -> tuple[Any, Any]:
    """The ``small`` Qwen3-shaped model (~16M parameters; ``tiny`` for a dry run) and its tokenizer,
    float32, deterministic in ``seed``."""
    from prime_node.ml.architectures import create_model

    model, tokenizer = create_model("qwen3", size, seed)
    return model, tokenizer


def prepare(out: Path, size: str = "small") -> dict[str, Any]:
    """Write the policy and the other-model cheater's model (another seed) as HF directories."""
    from prime_node.ml.model import save_model_dir

    params = 0
    for name, seed in (("policy", MODEL_SEED), ("other", OTHER_SEED)):
        model, tokenizer = small_model(seed, size)
        params = sum(p.numel() for p in model.parameters())
        save_model_dir(model, tokenizer, out / name)
    return {"model_params": params}


def run_config() -> Any:
    from prime_node.config import RunConfig

    return RunConfig.model_validate(
        {
            "run_id": "dtypes",
            "group_size": SAMPLES,
            "prompts_per_step": GROUPS,
            "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": TEMPERATURE,
            "async_level": 2,
            "seed": 7,
        }
    )


def load(model_dir: Path, dtype: str, device: str = "cpu", attn: str = "") -> Any:
    from prime_node.ml.engines import load_engine
    from prime_node.ml.tokenizer import load_tokenizer

    engine = load_engine(
        model_dir, load_tokenizer(model_dir), dtype=dtype, device=device, policy_step=CURRENT_STEP
    )
    if attn:
        engine.model.set_attn_implementation(attn)
    return engine


class PrefetchedEngine:
    """An engine answering ``generate`` from completions made ahead in large batches (``warm``), as a GPU
    inferer batches many scheduled batches' requests; a request not made ahead goes to the engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.policy_step = engine.policy_step
        self.model = engine.model
        self._made: dict[tuple[tuple[int, ...], int], Any] = {}

    def warm(self, requests: Sequence[tuple[list[int], int]], params: Any, batch: int) -> None:
        for start in range(0, len(requests), batch):
            chunk = requests[start : start + batch]
            done = self.engine.generate([p for p, _ in chunk], [s for _, s in chunk], params)
            for (prompt, seed), completion in zip(chunk, done, strict=True):
                self._made[(tuple(prompt), seed)] = completion

    def generate(self, prompts: Any, seeds: Any, params: Any) -> Any:
        keys = [(tuple(p), s) for p, s in zip(prompts, seeds, strict=True)]
        if params.return_hidden and all(k in self._made for k in keys):
            return [self._made.pop(k) for k in keys]
        return self.engine.generate(prompts, seeds, params)

    def prefill(self, prompts: Any, completions: Any) -> Any:
        return self.engine.prefill(prompts, completions)

    def load_weights(self, state: Any, policy_step: int) -> None:
        self.engine.load_weights(state, policy_step)


# -- records: the frames one inferer published -------------------------------------------------------------


def write_record(stream: Any, header: dict[str, Any], frames: Sequence[bytes]) -> None:
    head = json.dumps(header).encode()
    stream.write(struct.pack(">II", len(head), len(frames)) + head)
    for frame in frames:
        stream.write(struct.pack(">I", len(frame)) + frame)


def read_records(path: Path) -> Iterator[tuple[dict[str, Any], list[bytes]]]:
    with path.open("rb") as stream:
        while prefix := stream.read(8):
            head_len, count = struct.unpack(">II", prefix)
            header = json.loads(stream.read(head_len))
            frames = []
            for _ in range(count):
                (size,) = struct.unpack(">I", stream.read(4))
                frames.append(stream.read(size))
            yield header, frames


def generate(args: argparse.Namespace) -> dict[str, Any]:
    """Honest batches and attack attempts of one inferer configuration, into ``args.records``."""
    import copy

    import torch

    from prime_node.ml.engine import SamplingParams
    from prime_node.ml.engines import setup_engine
    from prime_node.ml.rollout_batch import scheduled_requests
    from prime_node.tasks.arithmetic import ArithmeticTask
    from prime_node.verification.cheating import ATTACKS, Scenario

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    engine = load(work / "policy", args.dtype, args.device, args.attn)
    tokenizer = load_tokenizer_of(work / "policy")
    perturbed = copy.deepcopy(engine.model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in perturbed.parameters():
            noise = torch.randn(parameter.shape, generator=generator).to(parameter.device)
            parameter.copy_((parameter.float() * (1 + 0.01 * noise)).to(parameter.dtype))
    if args.gen_batch:
        engine = PrefetchedEngine(engine)
    scenario = Scenario(
        config=run_config(),
        task=ArithmeticTask(2),
        tokenizer=tokenizer,
        engine=engine,
        current_step=CURRENT_STEP,
        now_ms=NOW_MS,
        _cheat_engines={
            "other_model": load(work / "other", args.dtype, args.device, args.attn),
            "perturbed_weights": setup_engine(perturbed, tokenizer, dtype=args.dtype),
        },
    )
    started = time.perf_counter()
    if args.gen_batch:
        config = scenario.config
        requests = []
        for counter in range(args.first_counter, args.first_counter + args.honest_batches):
            _, prompts, seeds = scheduled_requests(
                scenario.task,
                tokenizer,
                config,
                worker=scenario.key.address,
                policy_step=CURRENT_STEP,
                batch_counter=counter,
            )
            requests.extend(zip(prompts, seeds, strict=True))
        params = SamplingParams(config.max_new_tokens, config.temperature, return_hidden=True)
        engine.warm(requests, params, args.gen_batch)
    with Path(args.records).open("wb") as stream:
        for counter in range(args.first_counter, args.first_counter + args.honest_batches):
            frames = scenario.honest_frames(counter)
            write_record(stream, {"kind": "honest", "counter": counter}, frames)
        honest_s = time.perf_counter() - started
        for attack in ATTACKS if args.attempts else ():
            for attempt in range(args.attempts):
                counter = args.first_counter + 1_000_000 + attempt
                frames = scenario.attack_frames(attack, counter=counter)
                write_record(stream, {"kind": "attack", "attack": attack, "attempt": attempt}, frames)
    return {
        "run": "generate",
        "inferer": Side(args.dtype, args.kernels, args.threads).name,
        "device": args.device,
        "attn": args.attn or "default",
        "gen_batch": args.gen_batch,
        "honest_batches": args.honest_batches,
        "attempts_per_attack": args.attempts,
        "s_per_honest_batch": round(honest_s / max(1, args.honest_batches), 4),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def load_tokenizer_of(model_dir: Path) -> Any:
    from prime_node.ml.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


# -- validation ---------------------------------------------------------------------------------------------


class RecordingEngine:
    """The validator's real engine, keeping its last prefill so the distributions can be reported."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.policy_step = engine.policy_step
        self.last: list[Any] = []

    def generate(self, prompts: Any, seeds: Any, params: Any) -> Any:
        return self.engine.generate(prompts, seeds, params)

    def prefill(self, prompts: Any, completions: Any) -> Any:
        self.last = self.engine.prefill(prompts, completions)
        return self.last

    def load_weights(self, state: Any, policy_step: int) -> None:
        self.engine.load_weights(state, policy_step)


def distances(batch: Any, prefills: Sequence[Any]) -> dict[str, float]:
    """Worst chunk and worst token of a recomputed batch: what each bound of the validator is tested on."""
    import torch

    from prime_node.ml.engine import prefill_replay
    from prime_node.verification.proofs import check_proofs

    samples = list(batch.samples)
    completions = [list(s.completion_tokens()) for s in samples]
    checks = [
        c for per in check_proofs([p.hidden for p in prefills], [s.proof for s in samples]) for c in per
    ]
    own, margins = prefill_replay(prefills, completions, batch.temperature, [s.seed for s in samples])
    claimed = torch.tensor([v for s in samples for v in s.completion_logprobs()], dtype=torch.float32)
    return {
        "exp_mismatches": max(c.exp_mismatches for c in checks),
        "mant_err_mean": max(c.mant_err_mean for c in checks),
        "mant_err_median": max(c.mant_err_median for c in checks),
        "logprob_error": float((own.cpu() - claimed).abs().max()),
        "replay_margin": float(margins.max()),
        "chunks": len(checks),
    }


def validate(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    from crypto.toploc import Thresholds
    from prime_node.errors import NodeError
    from prime_node.ml.engines import calibration, engine_spec
    from prime_node.tasks.arithmetic import ArithmeticTask
    from prime_node.verification.cheating import EXPECTED_REASONS
    from prime_node.verification.proving import rollout_domain
    from prime_node.verification.validator import BatchValidator, CheckPolicy
    from protocol.envelope import EnvelopeVerifier

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    engine = RecordingEngine(load(work / "policy", args.dtype, args.device, args.attn))
    inferer = Side(args.inferer_dtype, args.inferer_kernels, args.inferer_threads)
    bounds = args.bounds
    if bounds == "table":
        try:
            pair = calibration(engine_spec("torch", inferer.dtype), engine_spec("torch", args.dtype))
        except NodeError:  # refused at configuration time: report the distributions that say why
            bounds = "refused (uncalibrated_engine)"
    if bounds == "table":
        policy = CheckPolicy(
            toploc=pair.toploc, logprob_tolerance=pair.sampling.logprob, replay_tolerance=pair.sampling.replay
        )
    else:
        policy = CheckPolicy(
            toploc=Thresholds(128, NO_BOUNDS, NO_BOUNDS),
            logprob_tolerance=NO_BOUNDS,
            replay_tolerance=NO_BOUNDS,
        )
    config, task, tokenizer = run_config(), ArithmeticTask(2), load_tokenizer_of(work / "policy")
    low = CURRENT_STEP - config.async_level

    def fresh() -> BatchValidator:
        return BatchValidator(
            config,
            task,
            tokenizer,
            lambda step: engine if low <= step <= CURRENT_STEP else None,
            rollout_verifier=EnvelopeVerifier(rollout_domain(config.run_id)),
            policy=policy,
        )

    honest_validator = fresh()
    honest = honest_rejected = 0
    rejected: dict[str, int] = {}
    worst: dict[str, list[float]] = {}
    caught: dict[str, int] = {}
    attempts: dict[str, int] = {}
    seen: dict[str, set[str]] = {}
    closest: dict[str, dict[str, float]] = {}
    raw_honest: list[dict[str, float]] = []
    raw_attacks: dict[str, list[dict[str, float]]] = {}
    shard, shards = (int(x) for x in args.shard.split("/"))
    records = (r for path in args.records.split(",") for r in read_records(Path(path)))
    honest_seen = 0
    started = time.perf_counter()
    for header, frames in records:
        if header["kind"] == "honest":
            honest_seen += 1
            if honest >= args.max_batches or (honest_seen - 1) % shards != shard:
                continue
            honest += 1
            engine.last = []
            result = honest_validator.validate_frame(frames[0], now_ms=NOW_MS, current_step=CURRENT_STEP)
            honest_rejected += int(not result.accepted)
            for reason in result.reasons:
                rejected[str(reason)] = rejected.get(str(reason), 0) + 1
            if engine.last and result.batch is not None:
                found = distances(result.batch, engine.last)
                raw_honest.append(found)
                for key, value in found.items():
                    worst.setdefault(key, []).append(value)
            continue
        if shard != 0:
            continue
        attack = header["attack"]
        validator = fresh()
        results = []
        for frame in frames:
            engine.last = []
            results.append(validator.validate_frame(frame, now_ms=NOW_MS, current_step=CURRENT_STEP))
        last = results[-1]
        attempts[attack] = attempts.get(attack, 0) + 1
        caught[attack] = caught.get(attack, 0) + int(
            (not last.accepted) and bool(set(last.reasons) & EXPECTED_REASONS[attack])
        )
        seen.setdefault(attack, set()).update(str(r) for r in last.reasons)
        if engine.last and last.batch is not None:
            # Per statistic, the attempt nearest to passing (the smallest batch-worst value).
            found = distances(last.batch, engine.last)
            raw_attacks.setdefault(attack, []).append(found)
            previous = closest.setdefault(attack, dict(found))
            for key, value in found.items():
                previous[key] = min(previous[key], value)
    rate = honest_rejected / max(1, honest)

    def summary(values: list[float]) -> dict[str, float]:
        array = np.asarray(values, dtype=np.float64)
        return {
            "max": _round(float(array.max())),
            "p99": _round(float(np.quantile(array, 0.99))),
            "p50": _round(float(np.quantile(array, 0.5))),
        }

    raw = {"raw_honest": raw_honest, "raw_attacks": raw_attacks} if args.raw else {}
    return {
        **raw,
        "run": "validate",
        "inferer": inferer.name,
        "validator": Side(args.dtype, args.kernels, args.threads).name,
        "device": args.device,
        "attn": args.attn or "default",
        "bounds": bounds,
        "bounds_used": _policy_json(policy)
        if bounds == "table"
        else "none: nothing rejected on recomputation",
        "honest_batches": honest,
        "honest_chunks": int(sum(worst.get("chunks", [0]))),
        "false_reject_rate": round(rate, 6),
        "false_reject_upper_95": round(_upper_95(honest_rejected, honest), 6),
        "honest_reject_reasons": rejected,
        "detected_by_attack": {a: round(caught[a] / attempts[a], 3) for a in attempts},
        "reasons_by_attack": {a: sorted(r) for a, r in seen.items()},
        "honest": {k: summary(v) for k, v in worst.items() if k != "chunks"} if worst else {},
        "attacks_closest": {a: {k: _round(v) for k, v in d.items()} for a, d in closest.items()},
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _round(value: float) -> float:
    return value if math.isinf(value) else float(f"{value:.4g}")


def _upper_95(events: int, n: int) -> float:
    """One-sided 95 % Clopper–Pearson upper bound on a rate from ``events`` in ``n`` trials (≈ 3/n for 0),
    found by bisection on the binomial tail so no statistics package is needed."""
    if n == 0 or events >= n:
        return 1.0
    low, high = events / n, 1.0
    for _ in range(60):
        p = (low + high) / 2
        tail = sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(events + 1))
        low, high = (p, high) if tail > 0.05 else (low, p)
    return high


def _policy_json(policy: Any) -> dict[str, float]:
    return {
        "max_exp_mismatches": policy.toploc.max_exp_mismatches,
        "max_mant_err_mean": policy.toploc.max_mant_err_mean,
        "max_mant_err_median": policy.toploc.max_mant_err_median,
        "logprob_tolerance": policy.logprob_tolerance,
        "replay_tolerance": policy.replay_tolerance,
    }


# -- driver -------------------------------------------------------------------------------------------------


def child(mode: str, side: Side, extra: list[str]) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), mode, *side.as_args(), *extra]
    done = subprocess.run(command, env=side.env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    line: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return line


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="?", default="all", choices=["all", "generate", "validate"])
    parser.add_argument("--honest-batches", type=int, default=1000)
    parser.add_argument("--attempts", type=int, default=5)
    parser.add_argument("--first-counter", type=int, default=0)
    parser.add_argument("--bounds", choices=["table", "measure"], default="table")
    parser.add_argument("--pairs", choices=["all", "fast"], default="all")
    parser.add_argument(
        "--inferers", choices=["all", F32, BF16], default="all", help="only this inferer's chain"
    )
    parser.add_argument(
        "--max-validate-batches",
        type=int,
        default=1 << 30,
        help="cap on honest batches a bf16 validator checks",
    )
    # child processes
    parser.add_argument("--dtype", default=F32)
    parser.add_argument("--kernels", default="native")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", default="")
    parser.add_argument("--records", default="")
    parser.add_argument("--inferer-dtype", default=F32)
    parser.add_argument("--inferer-kernels", default="native")
    parser.add_argument("--inferer-threads", type=int, default=1)
    parser.add_argument("--max-batches", type=int, default=1 << 30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attn", default="", help="attention implementation (eager, sdpa, ...)")
    parser.add_argument("--gen-batch", type=int, default=0, help="generate ahead in batches of N samples")
    parser.add_argument("--shard", default="0/1", help="validate honest records K, K+N, ... (K/N)")
    parser.add_argument("--raw", action="store_true", help="every batch's distances in the line")
    args = parser.parse_args()
    if args.mode == "generate":
        print(json.dumps(generate(args)))
        return
    if args.mode == "validate":
        print(json.dumps(validate(args)))
        return
    pairs = PAIRS if args.pairs == "all" else FAST_PAIRS
    pairs = {i: v for i, v in pairs.items() if args.inferers in ("all", i.dtype)}
    with tempfile.TemporaryDirectory(prefix="verification-dtypes-") as tmp:
        work = Path(tmp)
        facts = {"benchmark": "verification_dtypes", **prepare(work), "cpu_flags": _cpu_flags()}
        # One chain per inferer, the chains side by side (each process is single- or two-threaded).
        with ThreadPoolExecutor(max_workers=len(pairs)) as pool:
            for done in [pool.submit(chain, work, args, i, v, facts) for i, v in pairs.items()]:
                done.result()


def chain(
    work: Path, args: argparse.Namespace, inferer: Side, validators: list[Side], facts: dict[str, Any]
) -> None:
    """Generate one inferer's records, then check them with each of its validators; print each line."""
    records = work / f"{inferer.dtype}-{inferer.kernels}-{inferer.threads}.bin"
    common = ["--work", str(work), "--records", str(records)]
    counts = ["--honest-batches", str(args.honest_batches), "--attempts", str(args.attempts)]
    line = child("generate", inferer, [*common, *counts, "--first-counter", str(args.first_counter)])
    print(json.dumps({**facts, **line}), flush=True)
    for validator in validators:
        limit = args.max_validate_batches if validator.dtype == BF16 else 1 << 30
        inferer_args = ["--inferer-dtype", inferer.dtype, "--inferer-kernels", inferer.kernels]
        line = child(
            "validate",
            validator,
            [
                *common,
                *inferer_args,
                "--inferer-threads",
                str(inferer.threads),
                "--bounds",
                args.bounds,
                "--max-batches",
                str(limit),
            ],
        )
        print(json.dumps({**facts, **line}), flush=True)


def _cpu_flags() -> list[str]:
    """The vector extensions of this CPU that decide which ATen kernels ``native`` means."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    return sorted(f for f in flags if f.startswith(("avx", "amx")))


if __name__ == "__main__":
    main()
