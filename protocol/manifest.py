"""The checkpoint manifest: what a trainer signs so that untrusted peers can serve its weights.

A checkpoint directory is read as ONE byte stream (its files concatenated in path order) cut into pieces
of ``piece_size`` bytes (the last may be shorter). The manifest names every file with its offset and size
in that stream, the BLAKE3 hash of every piece, and a root over those hashes. Every byte a peer sends is
checked against a piece hash, so the swarm may be hostile: only the manifest needs trust, and it travels
inside an ``Envelope`` signed by the run's trainer key.

A manifest's id is BLAKE3 of its canonical encoding (the codec admits one byte form per value), which is
also the envelope's payload: ``fetch ID`` can check any envelope it is handed against the id it asked for.

Everything in a manifest is hostile input until checked, so ``__post_init__`` refuses: paths that are
absolute, contain ``..`` or odd characters, name a device Windows reserves (``COM1``, ``nul.txt``) or end
with a dot, repeat (also case-insensitively, for case-folding file
systems) or put a file "inside" another file; offsets that leave gaps or overlap; a piece count or root
that does not match; sizes beyond the caps below.

A manifest is either FULL (``base`` and ``target`` empty: the files are the checkpoint itself) or a DELTA
(both 32 bytes): its one file ``weights.delta`` turns the full version ``base`` (a manifest id) into the
full version ``target``, whose own signed manifest carries the piece hashes the reconstruction is checked
against, so a peer verifies what it rebuilds.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Annotated

from crypto.digests import DIGEST_SIZE, blake3
from crypto.keys import Address, WalletKey
from protocol.codec import ExactLen, IntRange, MaxLen, Message, decode, encode, message
from protocol.envelope import Domain, Envelope, check_signature, seal
from protocol.errors import InvariantError, RemoteProtocolError
from protocol.names import check_run_id

CHECKPOINT_KIND = "checkpoint"
MIN_PIECE_SIZE = 1 << 10
MAX_PIECE_SIZE = 16 << 20
MAX_PIECES = 1 << 17
MAX_FILES = 4096
MAX_PATH_CHARS = 255
MAX_COMPONENT_CHARS = 128
MAX_PATH_DEPTH = 8
MAX_TOTAL_SIZE = MAX_PIECES * MAX_PIECE_SIZE
MAX_MANIFEST_BYTES = MAX_PIECES * DIGEST_SIZE + MAX_FILES * (MAX_PATH_CHARS + 32) + 4096
DELTA_FILE_NAME = "weights.delta"
"""The one file of a delta version (its format: prime_node/swarm/delta_codec.py)."""
_ROOT_TAG = b"prime-node/swarm/root/v1"
_COMPONENT = re.compile(r"^[A-Za-z0-9._+=@,-]+$")
# Device names Windows reserves in every directory, with or without an extension ("nul.txt" opens the
# null device there); a peer on Windows must be able to write every file of a manifest it accepts.
_WINDOWS_DEVICES = frozenset(
    {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(10)), *(f"LPT{i}" for i in range(10))}
)


def check_relative_path(path: str) -> None:
    """A file name a manifest may carry: relative, '/'-separated, no '..', '.', empty or odd components."""
    if not path or len(path) > MAX_PATH_CHARS:
        raise InvariantError(f"path must be 1-{MAX_PATH_CHARS} characters", reason="bad_manifest")
    if path.startswith("/"):
        raise InvariantError(f"absolute path {path[:60]!r}", reason="bad_manifest")
    parts = path.split("/")
    if len(parts) > MAX_PATH_DEPTH:
        raise InvariantError(
            f"path {path[:60]!r} is more than {MAX_PATH_DEPTH} levels deep", reason="bad_manifest"
        )
    for part in parts:
        if part in ("", ".", ".."):
            raise InvariantError(
                f"path {path[:60]!r} has an empty, '.' or '..' component", reason="bad_manifest"
            )
        if len(part) > MAX_COMPONENT_CHARS or not _COMPONENT.match(part):
            raise InvariantError(
                f"path component {part[:60]!r} is too long or has characters outside [A-Za-z0-9._+=@,-]",
                reason="bad_manifest",
            )
        if part.split(".", 1)[0].upper() in _WINDOWS_DEVICES or part.endswith("."):
            raise InvariantError(
                f"path component {part[:60]!r} is a reserved device name or ends with '.' on Windows",
                reason="bad_manifest",
            )


def piece_root(piece_size: int, total_size: int, piece_hashes: bytes) -> bytes:
    """The root over the piece hashes: names the content independent of run, step and signer."""
    return blake3(_ROOT_TAG + struct.pack(">QQ", piece_size, total_size) + piece_hashes)


def piece_count_for(total_size: int, piece_size: int) -> int:
    return -(-total_size // piece_size)


@message("swarm.file", max_bytes=MAX_PATH_CHARS * 4 + 64)
@dataclass(frozen=True)
class FileEntry(Message):
    """One file of the checkpoint: its place ``[offset, offset + size)`` in the byte stream."""

    path: Annotated[str, MaxLen(MAX_PATH_CHARS)]
    offset: Annotated[int, IntRange(0, MAX_TOTAL_SIZE)]
    size: Annotated[int, IntRange(0, MAX_TOTAL_SIZE)]

    def __post_init__(self) -> None:
        check_relative_path(self.path)


@message("swarm.manifest", max_bytes=MAX_MANIFEST_BYTES)
@dataclass(frozen=True)
class Manifest(Message):
    """A signed description of one checkpoint version (see the module doc)."""

    run: Annotated[str, MaxLen(64)]
    step: Annotated[int, IntRange(0, (1 << 62) - 1)]
    piece_size: Annotated[int, IntRange(MIN_PIECE_SIZE, MAX_PIECE_SIZE)]
    total_size: Annotated[int, IntRange(1, MAX_TOTAL_SIZE)]
    files: Annotated[tuple[FileEntry, ...], MaxLen(MAX_FILES)]
    piece_hashes: Annotated[bytes, MaxLen(MAX_PIECES * DIGEST_SIZE)]
    root: Annotated[bytes, ExactLen(DIGEST_SIZE)]
    signer: Address
    base: Annotated[bytes, MaxLen(DIGEST_SIZE)] = b""
    """Delta only: the id of the full manifest the delta applies to."""
    target: Annotated[bytes, MaxLen(DIGEST_SIZE)] = b""
    """Delta only: the id of the full manifest the delta produces."""

    def __post_init__(self) -> None:
        check_run_id(self.run, label="run")
        self._check_delta_fields()
        if self.piece_size & (self.piece_size - 1):
            raise InvariantError(f"piece size {self.piece_size} is not a power of two", reason="bad_manifest")
        if len(self.piece_hashes) != piece_count_for(self.total_size, self.piece_size) * DIGEST_SIZE:
            raise InvariantError(
                f"{len(self.piece_hashes) // DIGEST_SIZE} piece hashes for {self.total_size} bytes "
                f"in pieces of {self.piece_size}",
                reason="bad_manifest",
            )
        if not self.files:
            raise InvariantError("a checkpoint has at least one file", reason="bad_manifest")
        expected_offset = 0
        seen: set[str] = set()
        previous = ""
        for entry in self.files:
            if entry.offset != expected_offset:
                raise InvariantError(
                    f"{entry.path!r} starts at {entry.offset}, expected {expected_offset}",
                    reason="bad_manifest",
                )
            if entry.path <= previous:
                raise InvariantError(
                    f"files are not in strictly increasing path order at {entry.path!r}",
                    reason="bad_manifest",
                )
            folded = entry.path.casefold()
            if folded in seen:
                raise InvariantError(
                    f"duplicate path {entry.path!r} (paths are compared case-insensitively)",
                    reason="bad_manifest",
                )
            seen.add(folded)
            previous = entry.path
            expected_offset += entry.size
        if expected_offset != self.total_size:
            raise InvariantError(
                f"files cover {expected_offset} bytes, manifest says {self.total_size}", reason="bad_manifest"
            )
        for entry in self.files:  # "a" and "a/b" cannot both be files
            parts = entry.path.casefold().split("/")
            for depth in range(1, len(parts)):
                if "/".join(parts[:depth]) in seen:
                    raise InvariantError(
                        f"{entry.path!r} lies under another file of the manifest", reason="bad_manifest"
                    )
        if self.root != piece_root(self.piece_size, self.total_size, self.piece_hashes):
            raise InvariantError("root does not match the piece hashes", reason="bad_manifest")

    def _check_delta_fields(self) -> None:
        if not self.base and not self.target:
            return
        if len(self.base) != DIGEST_SIZE or len(self.target) != DIGEST_SIZE:
            raise InvariantError(
                "a delta names both its base and its target (32-byte manifest ids)", reason="bad_manifest"
            )
        if self.base == self.target:
            raise InvariantError("a delta's base and target are the same version", reason="bad_manifest")
        if len(self.files) != 1 or self.files[0].path != DELTA_FILE_NAME:
            raise InvariantError(f"a delta holds exactly one file, {DELTA_FILE_NAME}", reason="bad_manifest")

    @property
    def is_delta(self) -> bool:
        """Does this version hold a delta (``base`` to ``target``) rather than a checkpoint?"""
        return bool(self.base)

    @property
    def piece_count(self) -> int:
        return len(self.piece_hashes) // DIGEST_SIZE

    def piece_hash(self, index: int) -> bytes:
        return self.piece_hashes[index * DIGEST_SIZE : (index + 1) * DIGEST_SIZE]

    def piece_span(self, index: int) -> tuple[int, int]:
        """``[start, end)`` of piece ``index`` in the byte stream."""
        if not 0 <= index < self.piece_count:
            raise IndexError(f"piece {index} outside 0..{self.piece_count - 1}")
        start = index * self.piece_size
        return start, min(start + self.piece_size, self.total_size)

    def piece_length(self, index: int) -> int:
        start, end = self.piece_span(index)
        return end - start

    def piece_is_valid(self, index: int, data: bytes, *, digest: bytes | None = None) -> bool:
        """Does ``data`` hash to piece ``index``'s recorded hash (and have its exact length)? ``digest``:
        the BLAKE3 of ``data`` if this node already computed it (the data plane does, on receipt), never
        a value a peer claimed."""
        if len(data) != self.piece_length(index):
            return False
        return (blake3(data) if digest is None else digest) == self.piece_hash(index)

    def id(self) -> bytes:
        """BLAKE3 of the canonical encoding: the name users pass to ``fetch``."""
        return blake3(encode(self))


def build_manifest(
    *,
    run: str,
    step: int,
    piece_size: int,
    files: list[tuple[str, int]],
    piece_hashes: bytes,
    signer: Address,
    base: bytes = b"",
    target: bytes = b"",
) -> Manifest:
    """A manifest for ``files`` (path, size) in path order; offsets and the root are derived here.
    ``base``/``target``: the full manifest ids a delta version turns one into the other (else empty)."""
    entries = []
    offset = 0
    for path, size in sorted(files):
        entries.append(FileEntry(path, offset, size))
        offset += size
    return Manifest(
        run=run,
        step=step,
        piece_size=piece_size,
        total_size=offset,
        files=tuple(entries),
        piece_hashes=piece_hashes,
        root=piece_root(piece_size, offset, piece_hashes),
        signer=signer,
        base=base,
        target=target,
    )


def checkpoint_domain(run: str) -> Domain:
    return Domain(CHECKPOINT_KIND, run)


def sign_manifest(key: WalletKey, manifest: Manifest, *, now_ms: int) -> Envelope:
    """Seal ``manifest`` in an envelope signed by ``key``, which must be the manifest's own signer."""
    if key.address != manifest.signer:
        raise InvariantError(
            f"manifest names signer {manifest.signer}, but the key is {key.address}", reason="bad_manifest"
        )
    return seal(key, checkpoint_domain(manifest.run), encode(manifest), now_ms=now_ms)


def open_manifest(
    envelope: Envelope, *, trainer: Address, run: str | None = None, expected_id: bytes | None = None
) -> Manifest:
    """The manifest inside ``envelope`` if the run's trainer signed it; RemoteProtocolError otherwise.

    No freshness or replay check: a checkpoint stays valid for as long as peers serve it, and receiving
    the same signed manifest twice is harmless (callers order versions by ``step``).
    """
    domain = Domain.parse(envelope.domain)
    if domain.kind != CHECKPOINT_KIND or (run is not None and domain.run != run):
        raise RemoteProtocolError(
            f"envelope is for {envelope.domain[:80]!r}, not a checkpoint of {run}", reason="wrong_domain"
        )
    check_signature(envelope)
    if envelope.signer != trainer:
        raise RemoteProtocolError(
            f"manifest signed by {envelope.signer}, but the run's trainer is {trainer}", reason="wrong_signer"
        )
    if expected_id is not None and blake3(envelope.payload) != expected_id:
        raise RemoteProtocolError("manifest does not have the requested id", reason="wrong_manifest_id")
    manifest = decode(envelope.payload, Manifest)
    if manifest.signer != envelope.signer or manifest.run != domain.run:
        raise RemoteProtocolError(
            "manifest's signer or run differs from its envelope's", reason="inconsistent_manifest"
        )
    return manifest
