"""The delta chain's I/O: carries out the plans of the sans-IO planner (protocol/swarm/rebuild.py).

The planner decides how a full version is obtained (held already, wait for another build, rebuild
through a chain of deltas, or fetch whole) and which obtain builds which version; this module only waits,
fetches the deltas and the target's manifest, rebuilds in a worker thread and holds the result. A build
that ends or gives a version up wakes every waiting obtain (one event: they plan again, and a plan that
still waits says so).
"""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from prime_node.errors import NodeError
from prime_node.swarm.delta_versions import rebuild_full
from prime_node.swarm.holdings import Holdings
from prime_node.swarm.store_layout import StoreLayout
from prime_node.swarm.transfer import OriginDirectory
from prime_node.swarm.versions import Version
from protocol.envelope import Envelope
from protocol.manifest import DELTA_FILE_NAME, Manifest
from protocol.swarm.rebuild import Build, FetchWhole, Have, Rebuild, RebuildPlanner, WaitFor

log = logging.getLogger(__name__)

StartFetch = Callable[[Manifest, Envelope, Path | None], Awaitable[Version]]
GetManifest = Callable[[bytes], Awaitable[tuple[Envelope, Manifest]]]


class HeldView:
    """The planner's view of the holdings."""

    def __init__(self, holdings: Holdings) -> None:
        self.holdings = holdings

    def held_step(self, mid: bytes) -> int | None:
        version = self.holdings.full(mid)
        return None if version is None else version.step

    def under_way_step(self, mid: bytes) -> int | None:
        version = self.holdings.versions.get(mid)
        return None if version is None or self.holdings.full(mid) is not None else version.step

    def delta_to(self, target: bytes) -> Manifest | None:
        return self.holdings.delta_to(target)


class DeltaChain:
    """Obtains full versions through deltas for the swarm service, which lends it its fetches
    (``start_fetch``, ``get_manifest``) and its bookkeeping of versions held (``hold``, ``drop``,
    ``retain``)."""

    def __init__(
        self,
        holdings: Holdings,
        layout: StoreLayout,
        *,
        start_fetch: StartFetch,
        get_manifest: GetManifest,
        hold: Callable[[Version], Version],
        drop: Callable[[Version], None],
        retain: Callable[[], None],
    ) -> None:
        self.holdings = holdings
        self.layout = layout
        self.planner: RebuildPlanner[Manifest] = RebuildPlanner(HeldView(holdings))
        self._start_fetch = start_fetch
        self._get_manifest = get_manifest
        self._hold = hold
        self._drop = drop
        self._retain = retain
        self._ended = trio.Event()
        """Set (and replaced) whenever a build ends or gives up a version: waiting obtains plan again."""
        self.reconstructions = 0
        self.bad_deltas = 0

    @property
    def versions(self) -> dict[bytes, Version]:
        return self.holdings.versions

    def in_flight(self, target: bytes) -> bool:
        return self.planner.in_flight(target)

    def claim(self, target: bytes, via: Manifest) -> Build[Manifest]:
        """Claim ``target`` now, for an ``obtain`` started later (a followed delta)."""
        return self.planner.claim(target, via)

    async def fetch(self, delta: Manifest, out: Path | None) -> Path:
        """The full directory ``delta`` produces (``fetch`` of a delta id): waits as long as it takes."""
        full = await self.obtain(self.planner.obtain(delta.target, delta), out=out, wait=math.inf)
        assert full.path is not None
        return full.path

    async def obtain(self, build: Build[Manifest], *, out: Path | None, wait: float) -> Version:
        """The full version ``build.target`` held complete: carries out the planner's plans."""
        try:
            while True:
                plan = build.next()
                if isinstance(plan, WaitFor):
                    await self._ended.wait()
                    continue
                if isinstance(plan, Have):
                    return await self._outcome(self.versions[plan.target])
                if isinstance(plan, Rebuild):
                    built = await self._rebuild(build, plan, out, wait)
                    if built is not None:
                        return built
                    plan = build.abandon()
                    self._wake()
                assert isinstance(plan, FetchWhole)
                log.info(
                    "fetching %s whole (no delta leads to it from a version held)", plan.target.hex()[:16]
                )
                return await self._fetch_full(plan.target, out, wait)
        finally:
            build.close()
            self._wake()

    def _wake(self) -> None:
        self._ended.set()
        self._ended = trio.Event()

    @staticmethod
    async def _outcome(version: Version) -> Version:
        await version.done.wait()
        if version.error is not None:
            raise version.error
        return version

    async def _rebuild(
        self, build: Build[Manifest], plan: Rebuild[Manifest], out: Path | None, wait: float
    ) -> Version | None:
        """Apply the plan's deltas in turn (``out`` is the last one's); None when one fails."""
        version, delta = self.versions[plan.base], plan.links[0]
        try:
            version = await self._outcome(version)
            for index, delta in enumerate(plan.links):
                last = index == len(plan.links) - 1
                version = await self._apply(delta, version, out if last else None, wait)
                build.built(delta)
                self._wake()
            return version
        except NodeError as exc:
            if exc.reason != "bad_delta":
                log.warning("could not rebuild step %d from a delta: %s", delta.step, exc)
            return None

    async def _apply(self, delta: Manifest, base: Version, out: Path | None, wait: float) -> Version:
        """Fetch ``delta``, rebuild its target from ``base`` and hold the target as a complete version."""
        delta_id = delta.id()
        fetched = self.versions.get(delta_id)
        if fetched is None:
            envelope = self.holdings.known.get(delta_id)
            if envelope is None:
                raise NodeError(f"no manifest for delta {delta_id.hex()}", reason="manifest_not_found")
            # held once this returns: its base stays while it waits
            fetched = await self._start_fetch(delta, envelope, None)
        full_envelope, full = await self._target_manifest(delta, wait)
        await fetched.done.wait()
        if fetched.error is not None:
            raise fetched.error
        held = self.versions.get(full.id())
        if held is not None:  # fetched whole meanwhile
            await held.done.wait()
            return held
        assert fetched.path is not None and base.path is not None
        directory = out if out is not None else self.layout.checkpoint_dir(full)
        if out is None and directory.exists():
            shutil.rmtree(directory)  # our own leftover from a run killed between rename and cleanup
        delta_file, base_dir = fetched.path / DELTA_FILE_NAME, base.path
        try:
            await trio.to_thread.run_sync(lambda: rebuild_full(base_dir, delta_file, full, directory))
        except NodeError as exc:
            if exc.reason == "bad_delta":
                self.bad_deltas += 1
                log.error(  # the trainer signed it: the trainer is at fault, not the peers that sent it
                    "refusing the trainer's delta %s for step %d (bad_delta): %s; fetching the step whole",
                    delta_id.hex()[:16],
                    delta.step,
                    exc,
                )
                self.holdings.forget_delta(delta)
                if self.versions.get(delta_id) is fetched:
                    self._drop(fetched)
            raise
        if out is None:
            self.layout.save_envelope(full.id(), full_envelope)
        source = OriginDirectory(directory, full)
        version = self._hold(
            self.holdings.add(full, full_envelope, source, store=None, path=directory, origin=False)
        )
        self.reconstructions += 1
        log.info("step %d rebuilt from delta %s: %s", full.step, delta_id.hex()[:16], directory)
        self._retain()
        return version

    async def _target_manifest(self, delta: Manifest, wait: float) -> tuple[Envelope, Manifest]:
        """The trainer-signed full manifest ``delta`` produces (same run and step)."""
        envelope, full = await self._manifest_within(delta.target, wait)
        if full.is_delta or full.run != delta.run or full.step != delta.step:
            raise NodeError(
                f"delta {delta.id().hex()[:16]} names a target that is not step {delta.step}'s full version",
                reason="bad_delta",
            )
        return envelope, full

    async def _manifest_within(self, mid: bytes, wait: float) -> tuple[Envelope, Manifest]:
        with trio.move_on_after(wait):
            return await self._get_manifest(mid)
        raise NodeError(f"no peer sent manifest {mid.hex()} within {wait:.0f} s", reason="manifest_not_found")

    async def _fetch_full(self, target: bytes, out: Path | None, wait: float) -> Version:
        """Fetch the full version ``target`` whole (the fallback of every delta)."""
        envelope, manifest = await self._manifest_within(target, wait)
        if manifest.is_delta:
            raise NodeError(f"{target.hex()} names a delta, not a full version", reason="bad_delta")
        version = self.versions.get(target)
        if version is None:
            version = await self._start_fetch(manifest, envelope, out)
        return await self._outcome(version)
