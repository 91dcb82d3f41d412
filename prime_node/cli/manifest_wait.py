"""What ``fetch`` says while it waits for a manifest no peer has sent yet, and when it gives up."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import typer

from prime_node.errors import NodeError

if TYPE_CHECKING:
    from crypto.keys import Address
    from prime_node.node.service import Node
    from prime_node.swarm.service import SwarmService
    from protocol.envelope import Envelope
    from protocol.manifest import Manifest

log = logging.getLogger(__name__)
PROGRESS_MAX_S = 10.0
"""``fetch`` says at least this often what it is doing while no peer has sent the manifest."""


class ManifestWait:
    """What ``fetch`` says while no peer has sent the manifest: how long, how many peers of the run it
    asked (over the whole wait), its data-plane neighbours and the run members it knows."""

    def __init__(self, swarm: SwarmService, running: Node, mid: bytes, run_id: str) -> None:
        self.swarm = swarm
        self.running = running
        self.mid = mid
        self.run_id = run_id
        self.asked: set[Address] = set()

    def line(self, waited: float, *, final: bool = False) -> str:
        pending = self.swarm.catalogue.pending.get(self.mid)
        if pending is not None:
            self.asked |= pending.asked
        members = len(self.running.membership.members())
        head = "gave up on" if final else "waiting for"
        hint = "" if members else f" (no node of run {self.run_id!r} reached: check --run and --bootstrap)"
        return (
            f"{head} manifest {self.mid.hex()[:16]}… after {waited:.0f} s: asked {len(self.asked)} peer(s) "
            f"of run {self.run_id!r}, none sent it; {len(self.swarm.dataplane.links)} data-plane "
            f"neighbour(s), {members} run member(s) known{hint}"
        )

    async def get(self, timeout: float) -> tuple[Envelope, Manifest]:
        """The manifest, with a progress line every so often; NodeError after ``timeout`` s, or at once
        when it is signed by another key than the trainer (``wrong_signer``)."""
        import trio

        started = trio.current_time()
        found = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.report, min(PROGRESS_MAX_S, max(1.0, timeout / 4)))
            with trio.move_on_after(timeout):
                found = await self.swarm.get_manifest(self.mid)
            nursery.cancel_scope.cancel()
        if found is None:
            typer.echo(self.line(trio.current_time() - started, final=True), err=True)
            raise NodeError(
                f"no peer offered manifest {self.mid.hex()} within {timeout:g} s", reason="manifest_not_found"
            )
        return found

    async def report(self, every: float) -> None:
        import trio

        started = trio.current_time()
        while True:
            await trio.sleep(every)
            line = self.line(trio.current_time() - started)
            log.info("%s", line)
            typer.echo(line, err=True)
