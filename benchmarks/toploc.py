"""TOPLOC on our torch engine: proof cost, validation cost, honest and tampered check distributions.

Prints ONE JSON line. All ratios are measured in this process against a baseline run in the same
process (generation of the same tokens), so machine noise mostly cancels.

What it does, per model size (tiny Qwen2-style models built from a config, float32, CPU):
  * generates ``--prompts`` completions of up to ``--tokens`` tokens with model A (seed 0), keeping the
    hidden states, and builds the proofs: ``proof_overhead`` = proof time / generation time;
  * validates them by one prefill with model A: ``validation_time_ratio`` = (prefill + check) / generation;
  * records per-chunk exponent mismatches and mantissa errors for honest work and for each attack that
    TOPLOC alone is meant to (or cannot) detect: a model with another seed, model A with weights
    perturbed by 1 % (w · (1 + 0.01·N(0, 1))), and one token of an honest completion replaced after
    the proof was built (the validator prefills the altered completion).

Usage: .venv/bin/python benchmarks/toploc.py [--prompts 64] [--tokens 96] [--sizes tiny,small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from crypto import toploc
from crypto.toploc import REFERENCE_THRESHOLDS
from prime_node.ml.engine import SamplingParams, TorchEngine
from prime_node.ml.engines import DEFAULT_ENGINE, engine_spec, setup_engine
from prime_node.ml.model import TinySpec, create_tiny_model, parameter_count
from prime_node.verification.proofs import build_proofs, check_proofs, proof_failure

# The engine this benchmark calibrates, and the thresholds currently recorded for it.
ENGINE = engine_spec(DEFAULT_ENGINE)
ENGINE_THRESHOLDS = ENGINE.toploc_thresholds()

SIZES = {
    "tiny": TinySpec(),  # ~0.12M parameters, hidden 64
    "small": TinySpec(hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=4),
}


def engine_for(model: Any, tokenizer: Any) -> TorchEngine:
    return setup_engine(model, tokenizer, engine=ENGINE.family)


def prompts_for(tokenizer: Any, count: int, rng: np.random.Generator) -> list[list[int]]:
    texts = [f"{a:02d}+{b:02d}=" for a, b in rng.integers(0, 100, size=(count, 2))]
    return [list(tokenizer(text)["input_ids"]) for text in texts]


def perturbed(model: Any, scale: float, seed: int) -> Any:
    import copy

    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in other.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.mul_(1 + scale * noise)
    return other


def summarize(checks: list[Any]) -> dict[str, Any]:
    exps = [c.exp_mismatches for c in checks]
    means = [c.mant_err_mean for c in checks]
    medians = [c.mant_err_median for c in checks]
    histogram: dict[str, int] = {}
    for value in exps:
        histogram[str(value)] = histogram.get(str(value), 0) + 1
    return {
        "chunks": len(checks),
        "exp_mismatches": {"min": min(exps), "median": statistics.median(exps), "max": max(exps)},
        "exp_mismatch_histogram": dict(sorted(histogram.items(), key=lambda item: int(item[0]))),
        "mant_err_mean": {"median": statistics.median(means), "max": max(means)},
        "mant_err_median_max": max(medians),
        "rejected_fraction": sum(ENGINE_THRESHOLDS.failure(c) is not None for c in checks) / len(checks),
        "rejected_fraction_reference_thresholds": sum(
            REFERENCE_THRESHOLDS.failure(c) is not None for c in checks
        )
        / len(checks),
    }


def rejected_fraction(checks: list[list[Any]]) -> float:
    return sum(proof_failure(per, ENGINE_THRESHOLDS) is not None for per in checks) / len(checks)


def run_size(name: str, spec: TinySpec, prompts_n: int, tokens: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    model_a, tokenizer = create_tiny_model(0, spec)
    model_b, _ = create_tiny_model(1, spec)
    model_p = perturbed(model_a, 0.01, seed=7)
    engine_a = engine_for(model_a, tokenizer)
    prompts = prompts_for(tokenizer, prompts_n, rng)
    seeds = [int(s) for s in rng.integers(0, 1 << 62, size=prompts_n)]
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, return_hidden=True)

    engine_a.generate(prompts[:2], seeds[:2], params)  # warm-up
    started = time.perf_counter()
    honest = engine_a.generate(prompts, seeds, params)
    generation_s = time.perf_counter() - started
    generated_tokens = sum(len(c.tokens) for c in honest)

    hiddens = [c.hidden for c in honest if c.hidden is not None]
    build_proofs(hiddens[:2])  # warm-up (inverse table)
    started = time.perf_counter()
    proofs = build_proofs(hiddens)
    proof_s = time.perf_counter() - started
    chunks = sum(-(-len(c.tokens) // toploc.CHUNK_TOKENS) for c in honest)

    completions = [c.tokens for c in honest]
    started = time.perf_counter()
    prefills = engine_a.prefill(prompts, completions)
    honest_checks = check_proofs([p.hidden for p in prefills], proofs)
    validation_s = time.perf_counter() - started

    results: dict[str, Any] = {
        "params": parameter_count(model_a),
        "hidden_size": spec.hidden_size,
        "generated_tokens": generated_tokens,
        "generation_tok_per_s": round(generated_tokens / generation_s, 1),
        "proof_us_per_chunk": round(proof_s / chunks * 1e6, 1),
        "proof_overhead": round(proof_s / generation_s, 4),
        "validation_time_ratio": round(validation_s / generation_s, 4),
        "proof_bytes_per_32_tokens": len(proofs[0]) // -(-len(completions[0]) // toploc.CHUNK_TOKENS),
    }
    flat_honest = [c for per in honest_checks for c in per]
    results["honest"] = summarize(flat_honest)
    results["honest_bit_exact_fraction"] = sum(
        c.exp_mismatches == 0 and c.mant_err_mean == 0 for c in flat_honest
    ) / len(flat_honest)
    # The validator usually prefills with another batch layout (other padding, other neighbours).
    single = [engine_a.prefill([p], [c])[0].hidden for p, c in zip(prompts, completions, strict=True)]
    results["honest_prefill_one_by_one"] = summarize([c for per in check_proofs(single, proofs) for c in per])
    picked = [int(i) for i in rng.permutation(len(prompts))[:16]]
    regrouped = engine_a.prefill([prompts[i] for i in picked], [completions[i] for i in picked])
    regrouped_checks = check_proofs([p.hidden for p in regrouped], [proofs[i] for i in picked])
    results["honest_prefill_other_batch"] = summarize([c for per in regrouped_checks for c in per])

    for label, model in (("other_seed", model_b), ("perturbed_1pct", model_p)):
        cheat = engine_for(model, tokenizer).generate(prompts, seeds, params)
        cheat_proofs = build_proofs([c.hidden for c in cheat if c.hidden is not None])
        cheat_prefill = engine_a.prefill(prompts, [c.tokens for c in cheat])
        checks = check_proofs([p.hidden for p in cheat_prefill], cheat_proofs)
        results[label] = summarize([c for per in checks for c in per])
        results[label]["completions_rejected"] = rejected_fraction(checks)

    # One token changed after the proof was built: only the chunk(s) after the change can notice.
    tampered = []
    touched_chunks = []
    for completion in completions:
        if len(completion) < 2:
            continue
        position = int(rng.integers(0, len(completion) - 1))
        altered = list(completion)
        altered[position] = (altered[position] + 1 + int(rng.integers(0, 50))) % len(tokenizer)
        tampered.append(altered)
        touched_chunks.append((position + 1) // toploc.CHUNK_TOKENS)  # first row whose input changed
    keep = [i for i, c in enumerate(completions) if len(c) >= 2]
    tampered_prefill = engine_a.prefill([prompts[i] for i in keep], tampered)
    checks = check_proofs([p.hidden for p in tampered_prefill], [proofs[i] for i in keep])
    touched = [per[chunk] for per, chunk in zip(checks, touched_chunks, strict=True)]
    results["one_token_changed"] = summarize(touched)
    results["one_token_changed"]["completions_rejected"] = rejected_fraction(checks)
    return {name: results}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--sizes", default="tiny,small")
    args = parser.parse_args()
    torch.set_num_threads(2)
    out: dict[str, Any] = {
        "benchmark": "toploc",
        "engine": {"family": ENGINE.family, "dtype": ENGINE.dtype},
        "thresholds": ENGINE_THRESHOLDS.__dict__,
    }
    for name in args.sizes.split(","):
        out.update(run_size(name, SIZES[name], args.prompts, args.tokens))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
