"""The naming rule shared by run ids and domain kinds: one definition, so every layer agrees on it.

A run id is part of every signed message's domain, of gossip topics and of the DHT key, so the config,
the node and every decoder must accept exactly the same set of names.
"""

from __future__ import annotations

import re

from protocol.errors import InvariantError

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
"""1-64 of ``[a-z0-9._-]``, starting alphanumeric (a pydantic ``Field(pattern=...)`` may use it)."""
RUN_ID_PATTERN = NAME_PATTERN
NAME_RULE = "must be 1-64 of [a-z0-9._-], starting alphanumeric"
_NAME = re.compile(NAME_PATTERN)


def is_valid_name(text: str) -> bool:
    """True if ``text`` follows the naming rule (run ids, domain kinds)."""
    return _NAME.fullmatch(text) is not None  # fullmatch: ``$`` alone would let a trailing newline in


def check_run_id(run_id: str, *, label: str = "run id") -> str:
    """Return ``run_id`` if it follows the rule; InvariantError(reason="bad_run_id") if not."""
    if not is_valid_name(run_id):
        raise InvariantError(f"{label} {run_id[:60]!r} {NAME_RULE}", reason="bad_run_id")
    return run_id
