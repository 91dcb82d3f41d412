"""Hypothesis strategy for signed-verdict payloads, whose accepted ⇔ no-reasons invariant random data rarely
meets. Importing this module also registers the ``verification.verdict`` type with the codec."""

from __future__ import annotations

from hypothesis import strategies as st

from crypto.keys import Address
from prime_node.verification.reasons import Reason
from protocol.verdict import MAX_REASONS, Verdict
from tests.strategies.messages import register_strategy


@st.composite
def verdicts(draw: st.DrawFn) -> Verdict:
    accepted = draw(st.booleans())
    reasons: list[str] = (
        []
        if accepted
        else draw(
            st.lists(st.sampled_from([str(r) for r in Reason]), min_size=1, max_size=MAX_REASONS, unique=True)
        )
    )
    return Verdict(
        run_id=draw(st.text(max_size=20)),
        batch_id=draw(st.binary(min_size=32, max_size=32)),
        worker=Address(draw(st.binary(min_size=20, max_size=20))),
        policy_step=draw(st.integers(0, (1 << 63) - 1)),
        batch_counter=draw(st.integers(0, (1 << 63) - 1)),
        accepted=accepted,
        reasons=tuple(reasons),
        rejected_samples=() if accepted else tuple(draw(st.lists(st.integers(0, 4095), max_size=8))),
        rewards=tuple(draw(st.lists(st.floats(-10.0, 10.0), max_size=16))) if accepted else (),
    )


register_strategy(Verdict, verdicts())
