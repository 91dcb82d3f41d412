"""How long ``fetch`` (and ``share``) keep serving a version once it is written: ``--seed-until``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from prime_node.errors import NodeError

if TYPE_CHECKING:
    from crypto.keys import Address
    from prime_node.swarm.service import SwarmService

log = logging.getLogger(__name__)

SWARM_SEED_LIMIT = 300.0
"""``--seed-until swarm`` stops serving after this many seconds even if a peer still lacks pieces."""
SEED_POLL = 0.25
SEED_IDLE = 10.0
"""``--seed-until swarm``: after this many seconds, a peer that has not asked us for a piece within the
last SEED_IDLE s no longer counts as wanting one."""


@dataclass(frozen=True)
class SeedPolicy:
    """How long ``fetch`` keeps serving once its copy is written (``--seed-until``)."""

    mode: str
    """"done", "swarm", "never" or "duration"."""
    seconds: float = 0.0
    """"duration": how long; "swarm": the most it waits for the swarm."""


def parse_seed_until(text: str) -> SeedPolicy:
    """``done`` | ``never`` | ``swarm`` | ``swarm:DURATION`` | ``DURATION`` (``90``, ``90s``, ``5m``)."""
    value = text.strip().lower()
    if value in ("done", "never"):
        return SeedPolicy(value)
    if value == "swarm":
        return SeedPolicy("swarm", SWARM_SEED_LIMIT)
    if value.startswith("swarm:"):
        return SeedPolicy("swarm", _duration(value[6:], text))
    return SeedPolicy("duration", _duration(value, text))


def _duration(value: str, text: str) -> float:
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(value[-1:], 1.0)
    number = value[:-1] if value[-1:] in ("s", "m", "h") else value
    try:
        seconds = float(number) * scale
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise NodeError(
            f"--seed-until: want done, swarm, swarm:DURATION, never or a duration (90s), not {text[:40]!r}",
            reason="bad_option",
        )
    return seconds


SeedEnd = Literal["done", "duration", "peers_hold_it", "peers_stopped_asking", "limit", "version_gone"]
"""Why ``seed_version`` returned: the policy said so at once (``done``) or after its time (``duration``);
every peer that lacked pieces now holds them; the ones still lacking have not asked for SEED_IDLE s; the
"swarm" policy's time limit; the version was dropped from the store."""


async def seed_version(swarm: SwarmService, mid: bytes, origin: Address, policy: SeedPolicy) -> SeedEnd:
    """Keep the node (and so the upload of ``mid``) running as ``policy`` says, then say (and log) why it
    stopped."""
    ended = await _seed(swarm, mid, origin, policy)
    log.info("stopped seeding %s: %s", mid.hex(), ended)
    return ended


async def _seed(swarm: SwarmService, mid: bytes, origin: Address, policy: SeedPolicy) -> SeedEnd:
    import trio

    if policy.mode == "done":
        return "done"
    if policy.mode == "never":
        await trio.sleep_forever()
    if policy.mode == "duration":
        await trio.sleep(policy.seconds)
        return "duration"
    written = swarm.clock.now()
    with trio.move_on_after(policy.seconds):
        while True:
            version = swarm.versions.get(mid)
            if version is None:
                return "version_gone"
            now = swarm.clock.now()
            # Wait for every peer that lacks pieces, but once we have served SEED_IDLE s, only for those
            # still asking us (a peer that lacks pieces and never requests them does not hold us).
            idle_rule = now - written >= SEED_IDLE
            since = now - SEED_IDLE if idle_rule else None
            if not [peer for peer in version.transfer.node.peers_wanting(since) if peer != origin]:
                return "peers_stopped_asking" if idle_rule else "peers_hold_it"
            await trio.sleep(SEED_POLL)
    return "limit"
