"""The fetching side of the weight swarm: fetch a version by id, and follow the trainer's versions.

``fetch`` downloads a version from peers (resuming from verified pieces) or, for a delta, obtains the full
version it produces through ``DeltaChain`` (delta_chain.py: rebuilt from a held base or a chain, else
fetched whole). With ``follow``, the catalogue names each trainer-signed version of the run it hears of,
newest first, and ``start_following`` fetches it: whole, or through a known delta when one leads to it.
``start_fetch`` opens one version's store once, however many callers come while it is being opened. The
swarm service (service.py) runs one ``Fetcher`` and finishes the versions it completes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from crypto.keys import Address
from prime_node.errors import NodeError
from prime_node.swarm.delta_chain import DeltaChain
from prime_node.swarm.holdings import Holdings
from prime_node.swarm.versions import Version, open_known
from protocol.envelope import Envelope
from protocol.manifest import Manifest
from protocol.swarm.catalogue import Catalogue

if TYPE_CHECKING:
    from protocol.swarm.rebuild import Build

log = logging.getLogger(__name__)

FOLLOW_MANIFEST_WAIT = 60.0
"""How long following (or a delta) waits for a full version's manifest before giving up on it."""


@dataclass(frozen=True)
class FetchHooks:
    """What fetching asks of the swarm service that runs it: the run's ``trainer`` (it may change),
    ``hold`` a version just added to the holdings (the catalogue offers it), ``finish`` a version whose
    pieces are all here, ``get_manifest`` (the exchange's), and the running service's ``nursery``."""

    trainer: Callable[[], Address | None]
    hold: Callable[[Version], Version]
    finish: Callable[[Version], Awaitable[None]]
    get_manifest: Callable[[bytes], Awaitable[tuple[Envelope, Manifest]]]
    nursery: Callable[[], trio.Nursery]


class Fetcher:
    """See the module doc."""

    def __init__(
        self,
        holdings: Holdings,
        catalogue: Catalogue[Address],
        chain: DeltaChain,
        run_id: str,
        hooks: FetchHooks,
    ) -> None:
        self.holdings = holdings
        self.catalogue = catalogue
        self.chain = chain
        self.run_id = run_id
        self.hooks = hooks
        self.opening: dict[bytes, trio.Event] = {}
        """Versions whose piece store is being opened (in a worker thread): set when it is held, or not."""

    async def fetch(self, manifest_id: bytes, *, out: Path | None = None) -> Path:
        """Download the version ``manifest_id`` from peers, verify it and return its complete directory
        (``out`` if given, written atomically; else inside the store). Resumes from verified pieces.
        For a delta's id, the full directory it produces: rebuilt from a held base (or a chain), else
        fetched whole."""
        version = self.holdings.versions.get(manifest_id)
        if version is None:
            envelope, manifest = await self.hooks.get_manifest(manifest_id)
            if manifest.is_delta:
                return await self.chain.fetch(manifest, out)
            version = self.holdings.versions.get(manifest_id)
            if version is None:
                version = await self.start_fetch(manifest, envelope, out)
        elif version.manifest.is_delta:
            return await self.chain.fetch(version.manifest, out)
        await version.done.wait()
        if version.error is not None:
            raise version.error
        assert version.path is not None
        return version.path

    async def start_fetch(self, manifest: Manifest, envelope: Envelope, out: Path | None) -> Version:
        """Hold ``manifest``'s version and fetch it (``Holdings.start_fetch``); a caller that comes while
        its store is being opened gets the same version (``out`` is the first caller's)."""
        mid = manifest.id()
        while (opening := self.opening.get(mid)) is not None:
            await opening.wait()
        held = self.holdings.versions.get(mid)
        if held is not None:
            return held
        opened = self.opening[mid] = trio.Event()
        try:
            version = self.hooks.hold(await self.holdings.start_fetch(manifest, envelope, out))
        finally:
            del self.opening[mid]
            opened.set()
        if version.store is not None and version.store.complete:
            self.hooks.nursery().start_soon(self.hooks.finish, version)
        return version

    async def _follow_full(self, manifest: Manifest, envelope: Envelope) -> None:
        try:
            await self.start_fetch(manifest, envelope, None)
        except NodeError as exc:
            log.warning("could not fetch checkpoint %s: %s", manifest.id().hex()[:16], exc)
            self.catalogue.follow_ended(manifest.id())

    def start_following(self, mid: bytes) -> None:
        """Fetch a version the catalogue follows, once its manifest proves it the trainer's, of our run."""
        try:
            envelope = self.holdings.known.get(mid)
            if envelope is None:
                raise NodeError(f"no manifest for {mid.hex()}", reason="manifest_not_found")
            manifest = open_known(envelope, mid, self.hooks.trainer())
            if manifest.run != self.run_id:
                log.warning("not following %s: it belongs to run %s", mid.hex()[:16], manifest.run)
                self.catalogue.follow_ended(mid)
            elif manifest.is_delta or self.holdings.delta_to(mid) is not None or self.chain.in_flight(mid):
                self.follow_via_delta(manifest)
            elif mid not in self.holdings.versions and mid not in self.opening:
                self.hooks.nursery().start_soon(self._follow_full, manifest, envelope)
        except NodeError as exc:
            log.warning("could not fetch checkpoint %s: %s", mid.hex()[:16], exc)
            self.catalogue.follow_ended(mid)

    def follow_via_delta(self, manifest: Manifest) -> None:
        """A followed delta, or a followed full version a known delta produces: obtain the full version
        through the delta (or its fallback) unless it is held or on its way already."""
        delta = manifest if manifest.is_delta else self.holdings.delta_to(manifest.id())
        target = manifest.target if manifest.is_delta else manifest.id()
        if delta is None or target in self.holdings.versions or self.chain.in_flight(target):
            self.catalogue.follow_ended(manifest.id())
            return
        build = self.chain.claim(target, delta)  # claimed now: the task starts later
        self.hooks.nursery().start_soon(self._follow_delta, delta, build)

    async def _follow_delta(self, delta: Manifest, build: Build[Manifest]) -> None:
        try:
            await self.chain.obtain(build, out=None, wait=FOLLOW_MANIFEST_WAIT)
        except NodeError as exc:
            log.warning("could not obtain step %d (%s): %s", delta.step, build.target.hex()[:16], exc)
        finally:
            for mid in (delta.id(), build.target):
                if mid not in self.holdings.versions:
                    self.catalogue.follow_ended(mid)
