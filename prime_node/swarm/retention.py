"""Apply the retention rule (protocol.swarm.retention) to a piece store root: keep the newest
``async_level + 1`` full steps of each run (with the deltas and bases that rule keeps), delete the rest
from disk."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from prime_node.errors import NodeError
from prime_node.swarm.piece_store import LOCK_FILE, lock_store, read_stored_manifest
from protocol.swarm.retention import HeldVersion, versions_to_drop

log = logging.getLogger(__name__)


def held_versions(root: Path) -> dict[HeldVersion, Path]:
    """Every readable manifest directory under ``root``."""
    found: dict[HeldVersion, Path] = {}
    if not root.is_dir():
        return found
    for directory in sorted(root.iterdir()):
        if not directory.is_dir():
            continue
        manifest = read_stored_manifest(directory)
        if manifest is not None and directory.name == manifest.id().hex():
            held = HeldVersion(manifest.run, manifest.step, manifest.id(), manifest.base, manifest.target)
            found[held] = directory
    return found


def apply_retention(root: Path, *, async_level: int) -> list[HeldVersion]:
    """Delete the versions the rule drops, except any a running process holds; returns those deleted."""
    held = held_versions(root)
    deleted = []
    for version in versions_to_drop(held, async_level=async_level):
        directory = held[version]
        try:
            lock_fd = lock_store(directory / LOCK_FILE)
        except NodeError as exc:
            log.info("keeping %s for now: %s", directory, exc)
            continue
        try:
            log.info("dropping checkpoint %s step %d (%s)", version.run, version.step, directory.name[:16])
            shutil.rmtree(directory, ignore_errors=True)
        finally:
            os.close(lock_fd)
        deleted.append(version)
    return deleted
