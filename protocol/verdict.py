"""The signed verdict a validator publishes about one rollout batch.

A verdict names the batch by the id of its envelope frame (BLAKE3 of the canonical bytes, so every
node computes the same id), repeats the header fields a trainer needs to match it with the batch,
and says which groups the validator replayed against the model (``verified_groups``: all of them, or
the secret sample of a validator that recomputes only some). An acceptance vouches for those groups
only: the trainer trains on the union of the verified groups of the accepting verdicts, and nothing
executes a completion outside it. The rewards are the validator's own, for the samples of the verified
groups in order (the trainer never trusts a worker's rewards and may compare its own with these). It
travels inside an Envelope of kind ``verdict`` signed by the validator's wallet key. Sans-IO: the caller
supplies ``now_ms`` and the verifier (replay cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

from crypto.keys import Address, WalletKey
from protocol.codec import ExactLen, IntRange, MaxLen, Message, decode, encode, message
from protocol.envelope import Domain, Envelope, EnvelopeVerifier, seal
from protocol.errors import InvariantError, RemoteProtocolError
from protocol.rollouts import MAX_SAMPLES

VERDICT_KIND = "verdict"
MAX_REASONS = 32
_U63 = (1 << 63) - 1


@message("verification.verdict", max_bytes=64 * 1024 + 16 * MAX_SAMPLES)
@dataclass(frozen=True)
class Verdict(Message):
    """Accepted, or rejected with reason codes (prime_node/verification/reasons.py), for one batch."""

    run_id: Annotated[str, MaxLen(64)]
    batch_id: Annotated[bytes, ExactLen(32)]
    worker: Address
    policy_step: Annotated[int, IntRange(0, _U63)]
    batch_counter: Annotated[int, IntRange(0, _U63)]
    accepted: bool
    reasons: Annotated[tuple[Annotated[str, MaxLen(64)], ...], MaxLen(MAX_REASONS)]
    rejected_samples: Annotated[tuple[Annotated[int, IntRange(0, MAX_SAMPLES - 1)], ...], MaxLen(MAX_SAMPLES)]
    rewards: Annotated[tuple[float, ...], MaxLen(MAX_SAMPLES)]
    verified_groups: Annotated[
        tuple[Annotated[int, IntRange(0, MAX_SAMPLES - 1)], ...], MaxLen(MAX_SAMPLES)
    ] = ()
    """Groups whose tokens this validator replayed, ascending; an accepted verdict that names none
    admits nothing to training (fail closed)."""

    def __post_init__(self) -> None:
        if self.accepted == bool(self.reasons):
            raise InvariantError(
                "a verdict is accepted exactly when it lists no reasons", reason="bad_verdict"
            )
        if self.accepted and self.rejected_samples:
            raise InvariantError("an accepted verdict rejects no samples", reason="bad_verdict")
        if len(set(self.reasons)) != len(self.reasons):
            raise InvariantError("reasons must not repeat", reason="bad_verdict")
        if any(b <= a for a, b in zip(self.verified_groups, self.verified_groups[1:], strict=False)):
            raise InvariantError("verified groups must be strictly ascending", reason="bad_verdict")
        if not self.accepted and self.verified_groups:
            raise InvariantError("a rejected verdict vouches for no group", reason="bad_verdict")
        if not all(math.isfinite(r) for r in self.rewards):
            raise InvariantError("rewards must be finite", reason="bad_verdict")


def verdict_domain(run_id: str) -> Domain:
    return Domain(VERDICT_KIND, run_id)


def seal_verdict(key: WalletKey, verdict: Verdict, *, now_ms: int) -> Envelope:
    """Sign ``verdict`` as the validator ``key``."""
    return seal(key, verdict_domain(verdict.run_id), encode(verdict), now_ms=now_ms)


def open_verdict(
    envelope: Envelope, verifier: EnvelopeVerifier, *, trusted: frozenset[Address], now_ms: int
) -> Verdict:
    """Check a verdict envelope (signature, domain, freshness, replay) and that a trusted validator signed it.

    RemoteProtocolError otherwise: ``untrusted_validator`` for a valid signature by anyone else.
    """
    verifier.verify(envelope, now_ms=now_ms)
    if envelope.signer not in trusted:
        raise RemoteProtocolError(
            f"verdict signed by untrusted {envelope.signer}", reason="untrusted_validator"
        )
    verdict = decode(envelope.payload, Verdict)
    if verdict_domain(verdict.run_id) != verifier.domain:
        raise RemoteProtocolError("verdict names another run than its envelope", reason="wrong_run")
    return verdict
