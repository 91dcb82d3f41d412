"""The signed verdict, re-exported for the I/O side: the wire message and its seal/open live in
protocol/verdict.py (sans-IO), where every node and the simulator can use them."""

from __future__ import annotations

from protocol.verdict import (
    MAX_REASONS,
    VERDICT_KIND,
    Verdict,
    open_verdict,
    seal_verdict,
    verdict_domain,
)

__all__ = ["MAX_REASONS", "VERDICT_KIND", "Verdict", "open_verdict", "seal_verdict", "verdict_domain"]
