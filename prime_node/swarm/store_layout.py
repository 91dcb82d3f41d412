"""Where the swarm service keeps checkpoint versions on disk, and what it finds there after a restart.

Under the store directory: ``manifests/<id>.envelope`` (the signed manifest), ``pieces/<id>/`` (a
PieceStore while fetching) and ``checkpoints/step-<step>-<id16>/`` (the complete directory; once it
exists the pieces are deleted and the version is served from the directory's files; a delta version's
directory holds its ``weights.delta``). Work directories (``checkpoints/.<name>``: a delta being encoded
or a full version being rebuilt from one) left by a killed process are removed on ``prepare``. Every
file read back is checked (hostile disk): a bad one is logged and skipped.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

from crypto.keys import Address
from prime_node.atomic_files import node_error_from_os, write_atomically
from protocol.codec import decode, encode
from protocol.envelope import Envelope
from protocol.errors import RemoteProtocolError
from protocol.manifest import Manifest, open_manifest

log = logging.getLogger(__name__)

SUBDIRECTORIES = ("manifests", "pieces", "checkpoints")


class StoreLayout:
    """The paths of one store directory and the few file operations the service does on them."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def pieces(self) -> Path:
        return self.root / "pieces"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def prepare(self) -> None:
        try:
            for sub in SUBDIRECTORIES:
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            for leftover in self.checkpoints.glob(".*"):
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError as exc:
            raise node_error_from_os(exc, f"preparing {self.root}") from exc

    def envelope_path(self, mid: bytes) -> Path:
        return self.root / "manifests" / f"{mid.hex()}.envelope"

    def checkpoint_dir(self, manifest: Manifest) -> Path:
        return self.checkpoints / f"step-{manifest.step}-{manifest.id().hex()[:16]}"

    def save_envelope(self, mid: bytes, envelope: Envelope) -> None:
        """Durably, so a restart finds the manifest of every store it resumes (NodeError on failure)."""
        write_atomically(self.envelope_path(mid), encode(envelope))

    def forget_envelope(self, mid: bytes) -> None:
        self.envelope_path(mid).unlink(missing_ok=True)

    def has_pieces(self, mid: bytes) -> bool:
        return (self.pieces / mid.hex()).is_dir()

    def delete_version(self, mid: bytes, directory: Path) -> None:
        """Delete a complete version's directory and manifest, only if they are inside the store."""
        if directory.is_relative_to(self.root):
            shutil.rmtree(directory, ignore_errors=True)
            self.forget_envelope(mid)

    def saved_manifests(self, trainer: Address | None) -> Iterator[tuple[bytes, Envelope, Manifest]]:
        """Every stored manifest whose id matches its file name and whose signer is ``trainer`` (any
        signer when None), in file-name order."""
        for path in sorted((self.root / "manifests").glob("*.envelope")):
            try:
                mid = bytes.fromhex(path.name.removesuffix(".envelope"))
                envelope = decode(path.read_bytes(), Envelope)
                manifest = open_manifest(envelope, trainer=trainer or envelope.signer, expected_id=mid)
            except (ValueError, OSError, RemoteProtocolError) as exc:
                log.warning("ignoring %s: %s", path, exc)
                continue
            yield mid, envelope, manifest
