"""The node's data-plane memory budget (prime_node/dataplane/budget.py): reservations, refusals and which
account is evicted when it is spent."""

from __future__ import annotations

import logging

import pytest

from prime_node.dataplane.budget import MemoryBudget
from prime_node.errors import NodeError


def test_reservations_within_the_limit_are_granted_and_released() -> None:
    budget = MemoryBudget(100)
    a, b = budget.account("a"), budget.account("b")
    assert a.reserve(60) and b.reserve(40)
    assert (budget.used, a.used, b.used, budget.peak) == (100, 60, 40, 100)
    a.release(60)
    assert budget.used == 40 and a.reserve(60)
    with pytest.raises(NodeError) as caught:
        b.release(41)
    assert caught.value.reason == "bad_release"
    b.close()
    assert budget.used == 60 and budget.accounts == 1
    b.release(10)  # closed: a no-op
    assert not b.reserve(1)
    with pytest.raises(NodeError):
        MemoryBudget(0)


def test_when_spent_the_greediest_account_is_evicted_and_its_bytes_count_as_freed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    budget = MemoryBudget(100)
    evicted: list[str] = []
    hoarder = budget.account("hoarder", lambda: evicted.append("hoarder"))
    small = budget.account("small", lambda: evicted.append("small"))
    honest = budget.account("honest", lambda: evicted.append("honest"))
    assert hoarder.reserve(70) and small.reserve(20)
    with caplog.at_level(logging.WARNING, logger="prime_node.dataplane.budget"):
        assert honest.reserve(30)
    assert evicted == ["hoarder"] and hoarder.evicted and budget.evictions == 1
    assert "closing hoarder" in caplog.text
    # The hoarder's 70 bytes are on their way out: nobody else is evicted for the next reservation ...
    assert honest.reserve(40) and evicted == ["hoarder"]
    assert budget.used == 160  # ... though they are held until the hoarder's owner lets go
    assert not hoarder.reserve(1)  # an evicted account gets nothing more
    hoarder.close()
    assert budget.used == 90 and budget.accounts == 2


def test_the_greediest_requester_is_refused_instead_of_evicting_others() -> None:
    budget = MemoryBudget(100)
    evicted: list[str] = []
    hoarder = budget.account("hoarder", lambda: evicted.append("hoarder"))
    other = budget.account("other", lambda: evicted.append("other"))
    assert other.reserve(30) and hoarder.reserve(70)
    assert not hoarder.reserve(1)  # it already holds the most: refused, nobody evicted
    assert budget.refusals == 1 and not evicted and budget.used == 100
    tie = MemoryBudget(100)
    left, right = tie.account("left"), tie.account("right")
    assert left.reserve(50) and right.reserve(40)
    assert not right.reserve(20)  # 60 against 50: the requester would be the greediest
    assert right.reserve(10)


def test_an_eviction_callback_may_reserve_elsewhere_without_corrupting_the_books() -> None:
    budget = MemoryBudget(100)
    bystander = budget.account("bystander")

    def on_evict() -> None:
        assert bystander.reserve(5)  # e.g. a close that queues a goodbye frame to another peer

    hoarder = budget.account("hoarder", on_evict)
    newcomer = budget.account("newcomer")
    assert hoarder.reserve(90)
    assert newcomer.reserve(50)
    assert hoarder.evicted and budget.used == 145 and bystander.used == 5
    hoarder.close()
    assert budget.used == 55
