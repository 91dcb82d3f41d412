"""The checkpoint versions a node holds or fetches: their transfers, stores and files, and the reads on
them (``locate``, ``newest``, waiting for a newer one). Which versions to hold is the catalogue's call
(protocol/swarm/catalogue.py); this module only does what it is told, on disk and in memory.

Delta versions (a ``weights.delta`` file, protocol/manifest.py) are held and served like any version, but
the reads inferers use (``locate``, ``newest``, ``wait_newer``, ``held_steps``) only ever name FULL
directories, which a model can load."""

from __future__ import annotations

import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from prime_node.errors import NodeError
from prime_node.swarm.piece_store import PieceStore
from prime_node.swarm.store_layout import StoreLayout
from prime_node.swarm.transfer import CheckpointTransfer, ClosePeer, OriginDirectory, PieceSource, SendFrame
from prime_node.swarm.versions import Version
from protocol.envelope import Envelope
from protocol.manifest import Manifest
from protocol.swarm.spread import SpreadMemory
from protocol.swarm.swarm_node import SwarmConfig

log = logging.getLogger(__name__)

MAX_STEPS_REPORTED = 16


class Holdings:
    """See the module doc."""

    def __init__(
        self,
        layout: StoreLayout,
        *,
        rng: random.Random,
        upload: bool,
        send: SendFrame,
        close: ClosePeer,
        on_complete: Callable[[Version], None],
    ) -> None:
        self.layout = layout
        self.rng = rng
        self.upload = upload
        self.send = send
        self.close = close
        self.on_complete = on_complete
        self.versions: dict[bytes, Version] = {}
        self.known: dict[bytes, Envelope] = {}
        """Every signed manifest we checked, by id (held versions' and those only heard of)."""
        self.deltas: dict[bytes, dict[bytes, Manifest]] = {}
        """The checked delta manifests by the full version they produce, then by their own id."""
        self.changed = trio.Event()
        self.spread_memory = SpreadMemory()
        """Super-seeding's hop time and peers' records, carried from each version to the next."""

    def learn(self, mid: bytes, envelope: Envelope, manifest: Manifest) -> None:
        """Remember a signed manifest the caller checked (``open_manifest``) and, for a delta, its link."""
        self.known[mid] = envelope
        if manifest.is_delta:
            self.deltas.setdefault(manifest.target, {})[mid] = manifest

    def forget_delta(self, delta: Manifest) -> None:
        """Never take ``delta`` again (it did not rebuild its target)."""
        self.deltas.get(delta.target, {}).pop(delta.id(), None)

    def delta_to(self, target: bytes) -> Manifest | None:
        """A known delta producing ``target``, one whose base we hold complete if there is one."""
        found = list(self.deltas.get(target, {}).values())
        held = [m for m in found if self.full(m.base) is not None]
        choices = held or found
        return choices[-1] if choices else None

    def full(self, mid: bytes) -> Version | None:
        """The complete full version ``mid``, if held."""
        version = self.versions.get(mid)
        if version is None or version.manifest.is_delta or version.path is None or not version.done.is_set():
            return None
        return version

    # --- reads ----------------------------------------------------------------------------------------

    def _complete_fulls(self) -> list[tuple[int, Path]]:
        return [
            (v.step, v.path)
            for v in self.versions.values()
            if v.path is not None and v.done.is_set() and not v.manifest.is_delta
        ]

    def locate(self, step: int) -> Path | None:
        return next((path for held, path in self._complete_fulls() if held == step), None)

    def newest(self) -> tuple[int, Path] | None:
        held = self._complete_fulls()
        return max(held, key=lambda item: item[0]) if held else None

    async def wait_newer(self, than: int | None) -> tuple[int, Path]:
        while True:
            newest = self.newest()
            if newest is not None and (than is None or newest[0] > than):
                return newest
            await self.changed.wait()

    def progress(self, manifest_id: bytes) -> tuple[int, int] | None:
        version = self.versions.get(manifest_id)
        if version is None:
            return None
        return version.transfer.node.have.bit_count(), version.manifest.piece_count

    def resumed_pieces(self, manifest_id: bytes) -> int:
        version = self.versions.get(manifest_id)
        return version.resumed_pieces if version is not None else 0

    def held_steps(self) -> tuple[int, ...]:
        """The newest complete steps (what the node's peer record advertises)."""
        steps = sorted({step for step, _ in self._complete_fulls()}, reverse=True)
        return tuple(steps[:MAX_STEPS_REPORTED])

    def status(self) -> list[dict[str, Any]]:
        return [v.status() for v in sorted(self.versions.values(), key=lambda v: v.step, reverse=True)]

    # --- changes --------------------------------------------------------------------------------------

    def add(
        self,
        manifest: Manifest,
        envelope: Envelope,
        source: PieceSource,
        *,
        store: PieceStore | None,
        path: Path | None,
        origin: bool,
    ) -> Version:
        """Hold a version: complete when ``path`` is given, else fetched into ``store``."""
        holder: list[Version] = []
        transfer = CheckpointTransfer(
            manifest,
            source,
            send=self.send,
            close=self.close,
            rng=random.Random(self.rng.getrandbits(64)),
            config=SwarmConfig(super_seed=origin),
            on_complete=lambda: self.on_complete(holder[0]),
            upload=self.upload,
            memory=self.spread_memory,
        )
        version = Version(manifest, envelope, transfer, store, path, origin)
        holder.append(version)
        mid = manifest.id()
        self.versions[mid] = version
        self.learn(mid, envelope, manifest)
        if path is not None:
            version.done.set()
            self.notify()
        return version

    async def start_fetch(self, manifest: Manifest, envelope: Envelope, out: Path | None) -> Version:
        """Hold a version to fetch into a piece store (resuming its verified pieces), its manifest saved
        beside; written to ``out`` when complete (None: inside the store).

        Opening the store reserves every file's space and hashes again each piece a resumed store claims:
        for a 62 GB checkpoint that is up to a minute of disk and BLAKE3 work (and where the file system
        cannot reserve space, glibc writes the zeros itself). It runs in a worker thread, so the node
        keeps beating and serving meanwhile; shielded, as a store opened and then dropped by a
        cancellation would keep its lock."""
        mid = manifest.id()
        with trio.CancelScope(shield=True):
            store = await trio.to_thread.run_sync(PieceStore.open, self.layout.pieces, manifest)
        try:
            self.layout.save_envelope(mid, envelope)
        except NodeError:
            store.close()
            raise
        version = self.add(manifest, envelope, store, store=store, path=None, origin=False)
        version.resumed_pieces = store.piece_count_held
        version.target = out
        log.info(
            "fetching step %d (%s): %d of %d pieces already verified on disk",
            manifest.step,
            mid.hex()[:16],
            store.piece_count_held,
            manifest.piece_count,
        )
        return version

    async def finish(self, version: Version) -> bool:
        """Write a fetched version's directory atomically, then serve from it and drop the pieces. False
        (with ``version.error`` set) if it cannot be written."""
        store = version.store
        if store is None or version.done.is_set():
            return False
        out = version.target
        target = out if out is not None else self.layout.checkpoint_dir(version.manifest)
        try:
            if out is None and target.exists():
                shutil.rmtree(target)  # our own leftover from a run killed between rename and cleanup
            await trio.to_thread.run_sync(store.materialize, target)
        except NodeError as exc:
            log.warning("cannot write step %d: %s", version.step, exc)
            version.error = exc
            return False
        store.close()
        store.remove()
        if out is not None:
            self.layout.forget_envelope(version.manifest.id())
        version.transfer.pieces = OriginDirectory(target, version.manifest)
        version.store = None
        version.path = target
        version.done.set()
        log.info("step %d complete: %s", version.step, target)
        return True

    def remove(self, version: Version, *, delete: bool, now: float) -> None:
        """Forget a version; ``delete`` its files too (only ever inside the store)."""
        mid = version.manifest.id()
        self.versions.pop(mid, None)
        for peer in list(version.transfer.node.peers):
            version.transfer.disconnected(peer, now)
        if version.store is not None:
            version.store.close()
        if delete and version.path is not None:
            self.layout.delete_version(mid, version.path)
        self.notify()

    def notify(self) -> None:
        """Wake whoever waits for a change of the versions held."""
        self.changed.set()
        self.changed = trio.Event()

    def close_stores(self) -> None:
        for version in self.versions.values():
            if version.store is not None:
                version.store.close()
