"""The trainer's side of the weight swarm: share and publish a step's checkpoint, with its delta.

``publish`` always builds, signs and seeds the full version of a step and, given the directory of a full
version the swarm holds as the base, also a delta version, encoded in the background (``_DeltaJob``, one
encode at a time: encodes share the cores) and announced instead of the full one when it is small enough
and ready within ``DELTA_WAIT`` of it (else after it: a slow delta never delays a policy; docs/deltas.md).
Announcements go on the gossip topic ``CHECKPOINTS_TOPIC`` (protocol/topics.py). Fetching, following and
holding versions stay with the swarm service (service.py), which runs one ``Publisher``.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from crypto.keys import Address, WalletKey
from prime_node.errors import NodeError
from prime_node.swarm.checkpoint_pieces import SharedCheckpoint, build_checkpoint
from prime_node.swarm.delta_versions import Published, encode_delta_version
from prime_node.swarm.holdings import Holdings
from prime_node.swarm.store_layout import StoreLayout
from prime_node.swarm.transfer import OriginDirectory
from prime_node.swarm.versions import Version
from protocol.codec import encode
from protocol.envelope import Envelope
from protocol.manifest import Manifest
from protocol.swarm.messages import MAX_ANNOUNCED_ENVELOPE_BYTES, Announce
from protocol.topics import CHECKPOINTS_TOPIC

if TYPE_CHECKING:
    from prime_node.node.context import NodeContext

log = logging.getLogger(__name__)

DELTA_WAIT = 5.0
"""Seconds ``publish`` holds back a step's announcement for its delta once the full version is ready: a
peer that hears of the full version first fetches it whole, so a delta announced later only serves late
peers. A delta slower than this never delays the policy further (it is announced when it is ready)."""


@dataclass
class _DeltaJob:
    """A delta ``publish`` encodes in the background: the outcome, and who announces it."""

    done: trio.Event = field(default_factory=trio.Event)
    published: Published | None = None
    announced: SharedCheckpoint | None = None
    """The delta version, when one was kept."""
    late: bool = False
    """``publish`` stopped waiting and announced the full version: the job announces the delta itself."""


@dataclass(frozen=True)
class PublishHooks:
    """What publishing asks of the swarm service that runs it: the run's ``trainer`` (it may change),
    ``hold`` a version just added to the holdings (the catalogue offers it), ``retain`` (apply the
    catalogue's retention), and the running service's ``context`` and ``nursery`` (NodeError
    ``not_running`` before it runs)."""

    trainer: Callable[[], Address | None]
    hold: Callable[[Version], Version]
    retain: Callable[[], None]
    context: Callable[[], NodeContext]
    nursery: Callable[[], trio.Nursery]


class Publisher:
    """See the module doc."""

    def __init__(
        self, key: WalletKey, run_id: str, holdings: Holdings, layout: StoreLayout, hooks: PublishHooks
    ) -> None:
        self.key = key
        self.run_id = run_id
        self.holdings = holdings
        self.layout = layout
        self.hooks = hooks
        self._encoding = trio.Lock()
        """Held while a delta is encoded: the encodes of successive steps take turns on the cores."""

    async def publish(
        self,
        directory: Path,
        *,
        step: int,
        delta_base: Path | None = None,
        snapshot: bool = False,
        max_delta_share: float = 0.5,
        piece_size: int | None = None,
        delta_wait: float = DELTA_WAIT,
        on_delta: Callable[[Published], None] | None = None,
    ) -> Published:
        """Share ``directory`` as step ``step``: its full version is always hashed, signed and seeded.
        Unless ``snapshot``, when ``delta_base`` is the directory of a full version this service holds,
        a delta against it is encoded too, in the background; if it is at most ``max_delta_share`` of the
        full size it is signed, seeded and announced instead of the full version (peers without the base
        fetch that) when it is ready within ``delta_wait`` seconds of the full version. Otherwise the full
        version is announced then (reason ``encoding``) and the delta, once ready, announced after it
        (for peers that did not start on the full version yet), and ``on_delta`` gets its outcome."""
        trainer = self.hooks.trainer()
        if trainer is not None and self.key.address != trainer:
            raise NodeError(
                f"only the run's trainer {trainer} may share checkpoints (this key is {self.key.address})",
                reason="not_trainer",
            )
        now_ms = self.hooks.context().clock.wall_ms()
        shared = await trio.to_thread.run_sync(
            lambda: build_checkpoint(
                directory, self.key, run=self.run_id, step=step, now_ms=now_ms, piece_size=piece_size
            )
        )
        full = shared.manifest
        mid = full.id()
        base = self._held_full_at(delta_base)
        reason = "snapshot" if snapshot else "no_base" if delta_base is None else "base_not_held"
        if not snapshot and base is not None and base.manifest.id() == mid:
            reason = "unchanged"
        elif not snapshot and base is not None:
            job = _DeltaJob()
            max_bytes = int(max_delta_share * full.total_size)
            self.hooks.nursery().start_soon(
                self._encode_delta, job, base, directory, shared, now_ms, max_bytes, on_delta
            )
            with trio.move_on_after(delta_wait):
                await job.done.wait()
            if job.published is not None:
                self._hold_origin(shared, directory)  # after the delta: neighbours are offered that first
                announced = job.announced if job.announced is not None else shared
                return await self._announce_published(job.published, announced)
            job.late = True
            reason = "encoding"
        self._hold_origin(shared, directory)
        return await self._announce_published(
            Published(
                full=full,
                delta=None,
                full_bytes=full.total_size,
                delta_bytes=0,
                encode_seconds=0.0,
                reason=reason,
            ),
            shared,
        )

    def _hold_origin(self, shared: SharedCheckpoint, directory: Path) -> None:
        """Seed the full version the trainer just built from its own directory."""
        if shared.manifest_id not in self.holdings.versions:
            source = OriginDirectory(directory, shared.manifest)
            self.hooks.hold(
                self.holdings.add(
                    shared.manifest, shared.envelope, source, store=None, path=directory, origin=True
                )
            )

    async def _announce_published(self, published: Published, announced: SharedCheckpoint) -> Published:
        """Announce ``announced`` (the delta of ``published``, or its full version) and log it."""
        await self.announce(announced.manifest, announced.envelope)
        self.hooks.retain()
        log.info(
            "sharing step %d as %s (%d pieces; %s%s)",
            published.full.step,
            announced.manifest_id.hex(),
            announced.manifest.piece_count,
            published.reason,
            f", {published.delta_bytes} of {published.full_bytes} bytes" if published.delta_bytes else "",
        )
        return published

    async def _encode_delta(
        self,
        job: _DeltaJob,
        base: Version,
        directory: Path,
        shared: SharedCheckpoint,
        now_ms: int,
        max_bytes: int,
        on_delta: Callable[[Published], None] | None,
    ) -> None:
        """Encode, sign and seed the delta of ``shared`` against ``base`` (one at a time: encodes share the
        cores), then hand it to ``publish`` or, if it stopped waiting, announce it here."""
        full = shared.manifest
        assert base.path is not None
        base_path, base_id = base.path, base.manifest.id()
        delta, delta_bytes, seconds, reason = None, 0, 0.0, "not_kept"
        try:
            async with self._encoding:
                delta, stats = await trio.to_thread.run_sync(
                    lambda: encode_delta_version(
                        base_path,
                        directory,
                        self.layout.checkpoints,
                        self.key,
                        full=full,
                        base_id=base_id,
                        now_ms=now_ms,
                        max_bytes=max_bytes,
                    )
                )
            delta_bytes, seconds = stats.delta_bytes, stats.seconds
            reason = "too_large" if delta is None else "delta"
        except NodeError as exc:  # e.g. the trainer removed a directory meanwhile: the full version stands
            log.warning("could not encode the delta of step %d: %s", full.step, exc)
        # Held (so offered) before it is announced: a neighbour hears of the delta first and takes it.
        if delta is not None and not self.hold_delta(delta.manifest, delta.envelope, delta.directory):
            delta, reason = None, "not_kept"
        published = Published(
            full=full,
            delta=delta.manifest if delta is not None else None,
            full_bytes=full.total_size,
            delta_bytes=delta_bytes,
            encode_seconds=seconds,
            reason=reason,
        )
        job.published, job.announced = published, delta
        job.done.set()
        if job.late:
            if delta is not None:
                await self._announce_published(published, delta)
            if on_delta is not None:
                on_delta(published)

    def _held_full_at(self, directory: Path | None) -> Version | None:
        if directory is None:
            return None
        wanted = directory.resolve()
        for version in self.holdings.versions.values():
            held = self.holdings.full(version.manifest.id())
            if held is not None and held.path is not None and held.path.resolve() == wanted:
                return held
        return None

    def hold_delta(self, manifest: Manifest, envelope: Envelope, work: Path) -> bool:
        """Move a delta the trainer just encoded where the store keeps versions, and seed it (False: it
        could not be kept, and is gone)."""
        mid = manifest.id()
        if mid in self.holdings.versions:
            shutil.rmtree(work, ignore_errors=True)
            return True
        directory = self.layout.checkpoint_dir(manifest)
        try:
            shutil.rmtree(directory, ignore_errors=True)
            work.rename(directory)
            self.layout.save_envelope(mid, envelope)
        except (OSError, NodeError) as exc:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(directory, ignore_errors=True)
            log.warning(
                "cannot keep the delta of step %d (announcing the full version): %s", manifest.step, exc
            )
            return False
        source = OriginDirectory(directory, manifest)
        self.hooks.hold(
            self.holdings.add(manifest, envelope, source, store=None, path=directory, origin=True)
        )
        return True

    async def announce(self, manifest: Manifest, envelope: Envelope) -> None:
        """Gossip a version on ``CHECKPOINTS_TOPIC``: its signed manifest inside when it fits, else its id."""
        payload = encode(envelope)
        announce = Announce(
            manifest.id(),
            self.run_id,
            manifest.step,
            payload if len(payload) <= MAX_ANNOUNCED_ENVELOPE_BYTES else b"",
        )
        try:
            await self.hooks.context().gossip.publish(CHECKPOINTS_TOPIC, encode(announce))
        except NodeError as exc:
            log.info("checkpoint announcement not gossiped (peers will still learn it on connect): %s", exc)
