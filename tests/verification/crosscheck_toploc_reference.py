"""Cross-check crypto.toploc against the reference `toploc` package (not a project dependency).

Run with an interpreter that has `toploc` 0.1.6 and torch installed (e.g. a throwaway venv):

    /tmp/toploc-venv/bin/python tests/verification/crosscheck_toploc_reference.py

It prints one JSON line. Checked: (1) for the same points, our proof bytes equal the reference's
``ProofPoly.from_points_tensor(...).to_bytes()``; (2) for whole activations, proofs built by
``toploc.build_proofs_bytes`` equal ours whenever both pick the same top-k set (ties at the 128th
magnitude may be broken differently: we break them by index, torch.topk does not promise any order);
(3) the reference verifier and ours report the same exponent-mismatch count, mantissa mean and
median, on honest and on perturbed activations, for proofs from either side.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import toploc  # type: ignore[import-not-found]
from toploc.C.csrc.poly import ProofPoly  # type: ignore[import-not-found]

from crypto import toploc as ours
from crypto import toploc_field as ours_field


def bits_of(tensor: torch.Tensor) -> np.ndarray:
    return tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def chunks_of(activations: torch.Tensor) -> list[np.ndarray]:
    bits = bits_of(activations)
    return [bits[i : i + ours.CHUNK_TOKENS].reshape(-1) for i in range(0, len(bits), ours.CHUNK_TOKENS)]


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    stats: dict[str, int] = {
        "points_cases": 0,
        "points_equal": 0,
        "build_cases": 0,
        "same_topk_set": 0,
        "build_equal_when_same_set": 0,
        "verify_cases": 0,
        "verify_equal": 0,
    }
    moduli_seen: set[int] = set()
    # (1) Encoding of identical points, including index ranges that force moduli below 65497.
    rng = np.random.default_rng(1)
    for case in range(300):
        span = [4096, 65497, 200_000, 2_000_000][case % 4]
        xs = rng.choice(span, size=128, replace=False).astype(np.int64)
        ys = rng.integers(0, 1 << 16, size=128).astype(np.int64)
        reference = ProofPoly.from_points_tensor(torch.from_numpy(xs), torch.from_numpy(ys)).to_bytes()
        moduli = ours_field.injective_moduli(xs[None, :])
        mine = ours.encode_proofs(moduli, ours_field.interpolate(xs[None, :] % moduli[:, None], ys[None, :]))[
            0
        ]
        stats["points_cases"] += 1
        stats["points_equal"] += reference == mine
        moduli_seen.add(int(moduli[0]))
    # (2) and (3): whole activations, hidden sizes from tiny to 4096 (flat indices beyond 65497).
    for hidden, tokens in [(64, 96), (128, 70), (896, 64), (4096, 64)]:
        for trial in range(6):
            activations = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
            reference = toploc.build_proofs_bytes(list(activations), 32, 128, skip_prefill=True)
            built = ours.commit_chunks(chunks_of(activations))
            for chunk_no, (a, b) in enumerate(zip(reference, built, strict=True)):
                stats["build_cases"] += 1
                flat = activations[chunk_no * 32 : (chunk_no + 1) * 32].reshape(-1)
                their_set = set(flat.abs().topk(128).indices.tolist())
                our_set = set(ours.top_entries(bits_of(flat)[None, :], 128)[0].tolist())
                if their_set == our_set:
                    stats["same_topk_set"] += 1
                    stats["build_equal_when_same_set"] += a == b
            noise = torch.randn(tokens, hidden, generator=generator) * 0.01 * trial
            recomputed = (activations.float() + noise).to(torch.bfloat16)
            for proofs in (reference, built):
                theirs = toploc.verify_proofs_bytes(recomputed, proofs, 32, 128, skip_prefill=True)
                checks = ours.check_chunks(chunks_of(recomputed), proofs)
                for chunk_no, (t, c) in enumerate(zip(theirs, checks, strict=True)):
                    flat = recomputed[chunk_no * 32 : (chunk_no + 1) * 32].reshape(-1)
                    if set(flat.abs().topk(128).indices.tolist()) != set(
                        ours.top_entries(bits_of(flat)[None, :], 128)[0].tolist()
                    ):
                        continue  # the two validators look at different indices (a tie at the 128th)
                    stats["verify_cases"] += 1
                    stats["verify_equal"] += (t.exp_mismatches, t.mant_err_mean, t.mant_err_median) == (
                        c.exp_mismatches,
                        c.mant_err_mean,
                        c.mant_err_median,
                    )
    print(json.dumps({**stats, "moduli_seen": sorted(moduli_seen)[:5], "toploc_version": toploc.__version__}))


if __name__ == "__main__":
    main()
