"""Verdict reason codes name envelope failures exactly as protocol/envelope.py does, so a reason seen in a
verdict and one seen in a node's log mean the same thing."""

from __future__ import annotations

from prime_node.verification.reasons import Reason
from protocol.envelope import Reject


def test_every_envelope_rejection_is_a_verdict_reason_with_the_same_code() -> None:
    assert {r.value for r in Reject} <= {r.value for r in Reason}


def test_reason_codes_are_unique() -> None:
    values = [r.value for r in Reason]
    assert len(values) == len(set(values))
