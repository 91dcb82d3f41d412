"""One byte budget for every data-plane channel of a node: frames being received and frames queued to send.

Per-channel caps alone let N peers pin N times the cap (32 inbound channels that never read were ~3 GiB).
Every channel therefore draws on one shared ``MemoryBudget`` through its ``BudgetAccount``: a
reservation is made before a buffer is allocated or a frame is queued, and released when the bytes are
handed over or sent. When a reservation does not fit, the greediest account is evicted (its owner is told
to close its channel) until it does; if the requester is itself the greediest, it is refused instead and
closes its own channel. Honest channels drain their bytes and hold little; a peer that hoards memory
holds the most and goes first.

An evicted account's bytes count as free at once when deciding whether more evictions are needed, so one
hoarder is not answered by closing its neighbours too. Its owner frees what it can before the reservation
that evicted it is counted (a DataPlane drops the link's send queue), and the rest when its cancelled
tasks unwind, so ``used`` passes ``limit`` only by buffers that are already being let go. Pure
bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prime_node.errors import NodeError

log = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = 256 << 20
"""Enough for every neighbour to have a 4 MiB piece in flight each way; hoarders are evicted long before
the ~3 GiB that 32 per-channel queues allowed."""

Evict = Callable[[], None]


class BudgetAccount:
    """One channel's share of a ``MemoryBudget``. ``evict`` is called (once) when the budget takes the
    account's bytes back: the owner must close its channel and then ``close`` the account."""

    def __init__(self, budget: MemoryBudget, name: str, evict: Evict | None) -> None:
        self.budget = budget
        self.name = name
        self.used = 0
        self.evicted = False
        self.closed = False
        self._evict = evict

    def reserve(self, size: int) -> bool:
        """Take ``size`` bytes; False (nothing taken) if the budget cannot give them to this account."""
        return self.budget._reserve(self, size)

    def release(self, size: int) -> None:
        """Give back ``size`` bytes taken earlier (a no-op once the account is closed)."""
        if not self.closed:
            self.budget._release(self, size)

    def close(self) -> None:
        """Give back everything and leave the budget (idempotent)."""
        if not self.closed:
            self.budget._release(self, self.used)
            self.closed = True
            self.budget._accounts.discard(self)


class MemoryBudget:
    """See the module doc. ``limit`` bytes across all accounts; ``peak`` is the most ever reserved."""

    def __init__(self, limit: int = DEFAULT_BUDGET_BYTES) -> None:
        if limit <= 0:
            raise NodeError(f"a memory budget must be positive, not {limit}", reason="bad_budget")
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.evictions = 0
        self.refusals = 0
        self._releasing = 0
        self._accounts: set[BudgetAccount] = set()

    def account(self, name: str, evict: Evict | None = None) -> BudgetAccount:
        """A new account (one per channel); ``name`` is for log lines."""
        account = BudgetAccount(self, name, evict)
        self._accounts.add(account)
        return account

    @property
    def accounts(self) -> int:
        return len(self._accounts)

    def _reserve(self, account: BudgetAccount, size: int) -> bool:
        if account.evicted or account.closed:
            return False
        victims: list[BudgetAccount] = []
        while self.used - self._releasing + size > self.limit:
            greediest = max(
                (other for other in self._accounts if not other.evicted),
                key=lambda other: (other.used + (size if other is account else 0), other is account),
            )  # on a tie the requester counts as the greediest: it is refused, nobody is evicted
            if greediest is account or greediest.used == 0:
                self.refusals += 1
                log.warning(
                    "data plane: refusing %d bytes to %s: the node's budget of %d MiB is spent "
                    "(%d bytes held, %d by this channel)",
                    size, account.name, self.limit >> 20, self.used, account.used,
                )  # fmt: skip
                self._notify(victims)
                return False
            greediest.evicted = True
            self._releasing += greediest.used
            self.evictions += 1
            victims.append(greediest)
            log.warning(
                "data plane: closing %s: it holds %d bytes, the most while the node's budget of %d MiB "
                "is spent",
                greediest.name, greediest.used, self.limit >> 20,
            )  # fmt: skip
        self._notify(victims)  # owners that free their bytes at once do so before we count these
        account.used += size
        self.used += size
        self.peak = max(self.peak, self.used)
        return True

    def _release(self, account: BudgetAccount, size: int) -> None:
        if size < 0 or size > account.used:
            raise NodeError(
                f"{account.name} releases {size} bytes but holds {account.used}", reason="bad_release"
            )
        account.used -= size
        self.used -= size
        if account.evicted:
            self._releasing -= size

    @staticmethod
    def _notify(victims: list[BudgetAccount]) -> None:
        """Tell owners after the bookkeeping is consistent: their callbacks may reserve elsewhere."""
        for victim in victims:
            if victim._evict is not None:
                victim._evict()
