"""Verdict reason codes name envelope failures exactly as protocol/envelope.py does, so a reason seen in a
verdict and one seen in a node's log mean the same thing."""

from __future__ import annotations

from enum import Enum, StrEnum

from prime_node.verification.reasons import Reason
from protocol.envelope import Reject


def test_every_envelope_rejection_is_a_verdict_reason_with_the_same_code() -> None:
    assert {r.value for r in Reject} <= {r.value for r in Reason}
    for reject in Reject:
        assert Reason[reject.name].value == reject.value


def duplicate_codes(enum: type[Enum]) -> list[str]:
    """Names whose value another name already has. ``__members__`` lists aliases; iterating skips them."""
    seen: dict[object, str] = {}
    duplicates = []
    for name, member in enum.__members__.items():
        if member.value in seen:
            duplicates.append(name)
        seen.setdefault(member.value, name)
    return duplicates


def test_reason_codes_are_unique() -> None:
    assert duplicate_codes(Reason) == []
    assert duplicate_codes(Reject) == []
    assert len(Reason.__members__) == len({member.value for member in Reason.__members__.values()})


def test_the_uniqueness_check_catches_an_alias() -> None:
    """A repeated value makes an alias that ``for r in Enum`` never yields: the check must still see it."""
    aliased = StrEnum("aliased", [("FIRST", "same"), ("SECOND", "same"), ("THIRD", "other")])
    assert len(list(aliased)) == 2  # what the old test iterated: the alias is invisible
    assert duplicate_codes(aliased) == ["SECOND"]
    assert len(aliased.__members__) != len({m.value for m in aliased.__members__.values()})
